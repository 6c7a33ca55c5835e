"""A mixture of experts on the CPU at a real shape: pagecli's 4-bit experts against llama.cpp's Q4_0.

    .venv/bin/python scripts/make_shape_models.py --shapes olmoe-1b-7b --out DIR [--llama-cpp SRC]
    .venv/bin/python scripts/bench_moe.py --model DIR/olmoe-1b-7b [--llama-cpp BUILD_BIN] [--gguf FILE]
        [--quantize int4] [--dtype auto] [--reps 3] [--threads 2] [--only pp512,tg128]

The model is OLMoE-1B-7B's shape with random weights (scripts/make_shape_models.py: 6.91B parameters, 64
experts of which a token takes 8: 1.17B active besides the embedding table). Figures, each run in a process
of its own, the contenders alternating within every repetition; medians with the range:
  pp512  a 512-token prompt prefilled (tokens/s), as llama-bench -p 512
  tg128  128 tokens decoded after a 1-token prompt (tokens/s), as llama-bench -n 128
  rss    the process's resident memory at its end and its peak (GB, /proc's VmRSS and VmHWM for pagecli;
         wait4's peak for llama-bench), with the weights' bytes: all of them, and those a decode token
         reads (its 8 experts of 64 in each layer, attention, the output layer)
pagecli runs the checkpoint in its default dtype (float32 on an AVX2-only CPU) with --quantize (int4: the
experts, attention and MLPs in 4-bit groups of 32, the output layer int8, the router in floats); llama.cpp
(when its build is given) runs --gguf (default: DIR.Q4_0.gguf beside the folder) with -t THREADS.
The CPU (lscpu's model name) is printed with the figures; say beside them whether the machine was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.moe import SparseMoE
task, model, threads, quantize, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
torch.set_num_threads(threads)
engine = Engine(model, EngineConfig(disk_cache=False, max_num_batched_tokens=4096, kv_budget_gib=1.0,
                                    quantize=quantize, dtype=dtype))
gen = torch.Generator().manual_seed(0)
def ids(n):
    return torch.randint(100, 40000, (n,), generator=gen).tolist()
engine.generate([ids(8)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
def timed(prompt, new):
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    start = time.perf_counter(); first = None; tokens = 0
    for ev in engine.stream():
        tokens += len(ev.token_ids)
        if first is None:
            first = time.perf_counter()
    return start, first, time.perf_counter(), tokens
if task == "pp512":
    start, first, end, _ = timed(ids(512), 1)
    rate = 512 / (first - start)
else:
    start, first, end, tokens = timed(ids(1), 128)
    rate = (tokens - 1) / (end - first)
def param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())
model = engine.loaded.model
spec = model.spec
experts = sum(param_bytes(layer.mlp.experts) for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
table = model.model.embed_tokens.weight
table_bytes = table.numel() * table.element_size() if table is not None else 0
# A decode token reads every weight but the embedding table's other rows and the experts it did not pick.
active = engine.weights_bytes - table_bytes - experts * (1 - spec.num_experts_per_tok / spec.num_experts)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
print(json.dumps({"rate": rate, "weights_bytes": engine.weights_bytes, "active_bytes": active,
                  "rss_gb": int(status["VmRSS"].split()[0]) / 1e6, "peak_gb": int(status["VmHWM"].split()[0]) / 1e6}))
"""


def pagecli_run(task: str, model: str, threads: int, quantize: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, task, model, str(threads), quantize, dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_run(task: str, gguf: str, bin_dir: str, threads: int) -> dict:
    flag = ["-p", "512", "-n", "0"] if task == "pp512" else ["-p", "0", "-n", "128"]
    child = subprocess.Popen([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-r", "1",
                              "-o", "json", *flag], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"llama-bench failed on {gguf}")
    return {"rate": float(json.loads(stdout)[0]["avg_ts"]), "peak_gb": usage.ru_maxrss / 1e6,
            "weights_bytes": os.path.getsize(gguf)}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp's build/bin folder (with llama-bench)")
    ap.add_argument("--gguf", default=None, help="the GGUF llama.cpp runs (default: MODEL.Q4_0.gguf)")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--dtype", default="auto", help="pagecli's --dtype (auto: bf16 for a batch engine where the CPU has it)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="pp512,tg128")
    args = ap.parse_args()
    model = args.model.rstrip("/")
    contenders = {f"pagecli {args.quantize}": lambda task: pagecli_run(task, model, args.threads, args.quantize,
                                                                         args.dtype)}
    if args.llama_cpp:
        gguf = args.gguf or f"{model}.Q4_0.gguf"
        name = f"llama.cpp {os.path.basename(gguf).removeprefix(os.path.basename(model) + '.').removesuffix('.gguf')}"
        contenders[name] = lambda task: llama_run(task, gguf, args.llama_cpp, args.threads)
    results: dict[tuple[str, str], list[dict]] = {}
    for task in args.only.split(","):
        for rep in range(args.reps):
            for name, run in contenders.items():
                got = run(task)
                results.setdefault((task, name), []).append(got)
                print(f"  {task} rep {rep + 1} {name}: {got['rate']:.2f} tok/s, peak {got['peak_gb']:.2f} GB",
                      flush=True)
    print(f"\n{os.path.basename(model)} on {cpu_name()}, {args.threads} threads, medians of {args.reps} "
          "alternating runs [min-max]")
    for (task, name), runs in results.items():
        rates = [r["rate"] for r in runs]
        line = f"{task:6} {name:22} {statistics.median(rates):8.2f} tok/s  [{min(rates):.2f}-{max(rates):.2f}]"
        peak = statistics.median(r["peak_gb"] for r in runs)
        line += f"  peak RSS {peak:.2f} GB"
        if "rss_gb" in runs[0]:
            line += (f", RSS at the end {statistics.median(r['rss_gb'] for r in runs):.2f} GB; weights "
                     f"{runs[0]['weights_bytes'] / 1e9:.2f} GB, {runs[0]['active_bytes'] / 1e9:.2f} GB a decode token")
        else:
            line += f"; file {runs[0]['weights_bytes'] / 1e9:.2f} GB"
        print(line)


if __name__ == "__main__":
    main()
