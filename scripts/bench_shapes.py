"""pagecli against llama.cpp at realistic model sizes: llama-bench's figures and a batched one.

    .venv/bin/python scripts/bench_shapes.py --model DIR --llama-cpp BUILD_BIN [--ggufs F16,Q8_0,Q4_0]
        [--reps 3] [--threads 2] [--only pp512,tg128,batch] [--quantize none,int8,int4,gguf,gguf@float32]
        [--kv-dtype auto] [--llama-extra="-fa on -ub 512"]

DIR is a folder made by scripts/make_shape_models.py (random weights of a real shape), with its
GGUF files beside it (DIR.F16.gguf, DIR.Q8_0.gguf, ...). Figures, each in its own process, the
contenders alternating within every repetition; medians with the range:
  pp512  a 512-token prompt prefilled (tokens/s), as llama-bench -p 512
  tg128  128 tokens decoded after a 1-token prompt (tokens/s), as llama-bench -n 128; also the
         weight bytes a token reads x tokens/s as a share of the memory's read bandwidth, measured
         by a plain read loop (pagecli.native.bandwidth, a process of its own) right after each run,
         since this machine's bandwidth swings between minutes (pagecli: the loaded weights' bytes,
         less an embedding table kept apart from the output layer, which gives one row a token;
         llama.cpp: the GGUF file's size)
  batch  16 sequences of 256 prompt tokens + 64 new: output tokens / total seconds, as
         llama-batched-bench -npp 256 -ntg 64 -npl 16 reports its whole-run speed
pagecli runs in its default dtype (bf16 where the CPU has bf16 arithmetic, else float32; pp512 and
tg128 run as one stream, as chat does, where a GGUF file's blocks take float32), once per
--quantize value (PAGECLI_CPU_ISA picks the kernel level; a value ending in @float32 loads the model
in float32, whose quantized products round activations to int16; one starting VAR=VALUE: sets that
variable for its runs, e.g. PAGECLI_BF16_WEIGHTS=0:none@float32;
`gguf` loads the first of --ggufs, DIR.<KIND>.gguf, and runs its blocks as they lie);
llama.cpp with -t THREADS and --llama-extra's flags (both tools: `-fa`, `-ub`, `-ctk`/`-ctv`, ...);
--kv-dtype sets pagecli's cache dtype for every pagecli run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, torch
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
task, model, threads, quantize, kv_dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
quantize, _, dtype = quantize.partition("@")
torch.set_num_threads(threads)
config = EngineConfig(dtype=dtype or "auto", disk_cache=False, max_num_batched_tokens=4096,
                      kv_budget_gib=2.0, max_num_seqs=16, quantize=quantize, kv_dtype=kv_dtype)
# one sequence at a time, as chat and a one-line generate run it (their `--dtype auto` reads it)
engine = Engine(model, config if task == "batch" else config.for_one_stream())
gen = torch.Generator().manual_seed(0)
def ids(n):
    return torch.randint(100, 40000, (n,), generator=gen).tolist()
engine.generate([ids(8)], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
def timed(prompts, new):
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    start = time.perf_counter(); first = None; tokens = 0
    for ev in engine.stream():
        tokens += len(ev.token_ids)
        if first is None:
            first = time.perf_counter()
    return start, first, time.perf_counter(), tokens
if task == "pp512":
    start, first, end, _ = timed([ids(512)], 1)
    rate = 512 / (first - start)
elif task == "tg128":
    start, first, end, tokens = timed([ids(1)], 128)
    rate = (tokens - 1) / (end - first)
else:
    start, first, end, tokens = timed([ids(256) for _ in range(16)], 64)
    rate = tokens / (end - start)
# The bytes a decode token reads: every weight, less an embedding table that only gives its one row (it
# is not the output layer's storage: untied, or the output layer packed or quantized apart from it).
model = engine.loaded.model
table = model.model.embed_tokens.weight
apart = table is not None and (model.output_packed is not None or not model.spec.tie_word_embeddings)
read_bytes = engine.weights_bytes - (table.numel() * table.element_size() if apart else 0)
print(json.dumps({"rate": rate, "read_bytes": read_bytes}))
"""

READ_CHILD = r"""
import json, statistics, sys, torch
from pagecli import native
from pagecli.native.bandwidth import read_bandwidth
torch.set_num_threads(int(sys.argv[1]))
print(json.dumps({"rate": statistics.median(read_bandwidth(native.cpu_ops(), repeats=3))}))
"""


def read_rate(threads: int) -> float:
    """GB/s of a plain read loop on `threads` threads, in a process of its own."""
    out = subprocess.run([sys.executable, "-c", READ_CHILD, str(threads)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["rate"]


def pagecli_rate(task: str, model: str, threads: int, quantize: str, kv_dtype: str) -> tuple[float, int]:
    """(tokens/s, the weight bytes a decode token reads). quantize may start with VAR=VALUE: settings of
    the child's environment (PAGECLI_BF16_WEIGHTS=0:none@float32)."""
    env = dict(os.environ)
    while ":" in quantize and "=" in quantize.split(":", 1)[0]:
        setting, quantize = quantize.split(":", 1)
        name, _, value = setting.partition("=")
        env[name] = value
    out = subprocess.run([sys.executable, "-c", CHILD, task, model, str(threads), quantize, kv_dtype],
                         capture_output=True, text=True, check=True, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["rate"], result["read_bytes"]


def llama_rate(task: str, gguf: str, bin_dir: str, threads: int, extra: list[str]) -> tuple[float, int]:
    """(tokens/s, the GGUF file's bytes)."""
    return llama_tokens_per_s(task, gguf, bin_dir, threads, extra), os.path.getsize(gguf)


def llama_tokens_per_s(task: str, gguf: str, bin_dir: str, threads: int, extra: list[str]) -> float:
    if task == "batch":
        out = subprocess.run([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-c", "8192", "-b", "2048",
                              "-ub", "512", "-npp", "256", "-ntg", "64", "-npl", "16", "-t", str(threads), *extra],
                             capture_output=True, text=True, check=True)
        row = [line for line in out.stdout.splitlines() if re.match(r"\|\s+256 \|", line)][-1]
        cells = [c.strip() for c in row.strip("|").split("|")]
        total_tokens_s, new_tokens = float(cells[-1]), 16 * 64
        total_s = float(cells[-2])
        return new_tokens / total_s if total_s else total_tokens_s
    flag = ["-p", "512", "-n", "0"] if task == "pp512" else ["-p", "0", "-n", "128"]
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json",
                          *flag, *extra], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp's build/bin folder")
    ap.add_argument("--ggufs", default="F16,Q8_0,Q4_0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="pp512,tg128,batch")
    ap.add_argument("--quantize", default="none",
                    help="pagecli's weight formats to run, e.g. none,int8 (FORMAT@float32: a float32 model)")
    ap.add_argument("--kv-dtype", default="auto", help="pagecli's KV cache dtype (auto, int8, fp8, ...)")
    ap.add_argument("--llama-extra", default="", help="more flags for llama-bench and llama-batched-bench")
    args = ap.parse_args()
    extra = args.llama_extra.split()
    model = args.model.rstrip("/")
    # `gguf` runs a .gguf file's own blocks: the first of --ggufs beside the model folder.
    gguf_model = f"{model}.{args.ggufs.split(',')[0]}.gguf"
    contenders = {f"pagecli {q.replace('none@', '')}":
                  (lambda task, q=q: pagecli_rate(task, gguf_model if q.split(":")[-1].startswith("gguf") else model,
                                                  args.threads, q, args.kv_dtype))
                  for q in args.quantize.split(",")}
    for kind in args.ggufs.split(","):
        contenders[f"llama.cpp {kind}"] = (lambda task, g=f"{model}.{kind}.gguf": llama_rate(task, g, args.llama_cpp,
                                                                                              args.threads, extra))
    results: dict[tuple[str, str], list[float]] = {}
    weight_bytes: dict[str, int] = {}
    shares: dict[str, list[float]] = {}  # tg128: each run's GB/s over the read loop's right after it
    reads: list[float] = []
    for task in args.only.split(","):
        for rep in range(args.reps):
            for name, run in contenders.items():
                rate, nbytes = run(task)
                results.setdefault((task, name), []).append(rate)
                line = f"  {task} rep {rep + 1} {name}: {rate:.1f} tok/s"
                if task == "tg128":
                    weight_bytes[name] = nbytes
                    read = read_rate(args.threads)
                    reads.append(read)
                    shares.setdefault(name, []).append(rate * nbytes / 1e9 / read)
                    line += f" ({rate * nbytes / 1e9:.1f} GB/s; read loop right after: {read:.1f} GB/s)"
                print(line, flush=True)
    print(f"\n{os.path.basename(model)}, {args.threads} threads, medians of {args.reps} alternating runs [min-max]")
    for (task, name), rates in results.items():
        line = f"{task:6} {name:18} {statistics.median(rates):8.1f} tok/s  [{min(rates):.1f}-{max(rates):.1f}]"
        if task == "tg128":
            got = shares[name]
            line += (f"  {weight_bytes[name] / 1e9:.2f} GB a token, {statistics.median(got):.0%} of the read loop "
                     f"[{min(got):.0%}-{max(got):.0%}]")
        print(line)
    if reads:
        print(f"read loop, {args.threads} threads: {statistics.median(reads):.1f} GB/s [{min(reads):.1f}-{max(reads):.1f}]")


if __name__ == "__main__":
    main()
