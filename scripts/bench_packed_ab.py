"""A/B of the engine's weight kernels on SmolLM2-135M (embedded), bf16 activations. Variants:
  rows:   PAGECLI_PACKED_GEMM=0, row-layout weights (the few-row kernel, oneDNN above 4 rows);
  packed: the packed bf16 GEMM (gemm_bf16.cpp), the default on AVX512-BF16 without AMX;
  int8:   --quantize int8 (quant_int8.cpp) for the decoder layers, the output layer packed bf16.

    .venv/bin/python scripts/bench_packed_ab.py [--rounds 3] [--threads 2] [--variants rows,packed]

Each round runs both variants, in alternating order, each in a fresh process (so one variant's
memory and caches do not favour the other). A process measures, after a warm-up:
  - single stream: one short chat-style prompt, 128 new tokens; decode tok/s = 127 / (time of the
    run - time to the first token), first token timed by the same prompt with 1 new token;
  - batch: 16 prompts at once, 64 new tokens each; tok/s = all new tokens / wall time (prefill
    included);
and the greedy tokens of both, so the variants' outputs can be compared. Prints per-run figures,
then per variant the median and [min-max], and how many greedy tokens the variants share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
BATCH_PROMPTS = [f"Question {i}: explain in simple words why the sky is {c}." for i, c in
                 enumerate(["blue", "red at dusk", "dark at night", "grey in winter"] * 4)]


def measure(threads: int, quantize: str) -> dict:
    import torch

    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine
    from pagecli.models.source import prepare_default_model

    torch.set_num_threads(threads)
    settings = {"dtype": "bfloat16", "disk_cache": False, "enable_prefix_caching": False}
    if quantize != "none":
        settings["quantize"] = quantize
    engine = Engine(str(prepare_default_model()), EngineConfig(**settings))
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    engine.generate([PROMPT], greedy(8))  # first-call costs
    start = time.perf_counter()
    engine.generate([PROMPT], greedy(1))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    [single] = engine.generate([PROMPT], greedy(128))
    single_s = time.perf_counter() - start
    start = time.perf_counter()
    batch = engine.generate(BATCH_PROMPTS, greedy(64))
    batch_s = time.perf_counter() - start
    return {"decode_tok_s": 127 / (single_s - first_s), "batch_tok_s": 16 * 64 / batch_s,
            "single_tokens": list(single.token_ids), "batch_tokens": [list(o.token_ids) for o in batch]}


def run_child(variant: str, threads: int) -> dict:
    env = {**os.environ, "PAGECLI_PACKED_GEMM": "0" if variant == "rows" else "1"}
    quantize = "int8" if variant == "int8" else "none"
    out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads), "--quantize", quantize],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantize", default="none", help=argparse.SUPPRESS)  # a child's setting
    ap.add_argument("--variants", default="rows,packed", help="comma-separated: rows, packed, int8")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads, args.quantize)))
        return
    variants = args.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for variant in order:
            res = run_child(variant, args.threads)
            results[variant].append(res)
            print(f"round {r + 1} {variant:6s}: decode {res['decode_tok_s']:.1f} tok/s, "
                  f"batch 16x64 {res['batch_tok_s']:.1f} tok/s", flush=True)
    for variant, runs in results.items():
        for key in ("decode_tok_s", "batch_tok_s"):
            values = [run[key] for run in runs]
            print(f"{variant:6s} {key}: median {statistics.median(values):.1f} "
                  f"[{min(values):.1f}-{max(values):.1f}] over {len(values)} runs")
    if len(variants) == 2:
        a, b = (results[v][0] for v in variants)
        pairs = [(a["single_tokens"], b["single_tokens"])] + list(zip(a["batch_tokens"], b["batch_tokens"]))
        same_seqs = sum(x == y for x, y in pairs)
        prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in pairs]
        print(f"greedy outputs {variants[0]} vs {variants[1]}: {same_seqs}/{len(pairs)} sequences identical; "
              f"first differing token per sequence: {prefix}")


if __name__ == "__main__":
    main()
