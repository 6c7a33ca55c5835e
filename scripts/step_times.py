"""Where an engine run of one bench_peers workload spends its time, by kind of step.

    .venv/bin/python scripts/step_times.py [batch|shared] [--threads 2] [--block-size 16] [--max-num-batched-tokens 2048]

Runs the workload (the same prompts as scripts/bench_peers.py, bfloat16 where the CPU has it,
prefix caching on) in this process and times every model step, grouped as prefill-only
(prompt chunks alone), mixed (prompt chunks and decodes together) and decode-only, plus the
time outside the model (scheduling, sampling, detokenizing). Use it to see which part a kernel
change moves; bench_peers.py gives the figures to compare with other engines.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.source import prepare_default_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import build_workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", nargs="?", default="batch", choices=["batch", "shared"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block")
    ap.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                    help="the token budget of a step (prompt chunks and decodes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(prepare_default_model())
    prompts = build_workloads(folder)[args.task]
    engine = Engine(folder, EngineConfig(dtype="auto", disk_cache=False, block_size=args.block_size,
                                         max_num_batched_tokens=args.max_num_batched_tokens))
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=2))  # first-call costs

    runner, execute = engine.runner, engine.runner.execute
    steps: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])  # count, seconds, tokens

    def timed(scheduled):
        start = time.perf_counter()
        logits = execute(scheduled)
        seconds = time.perf_counter() - start
        prompt = sum(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
        decodes = sum(1 for s in scheduled if s.num_new_tokens == 1)
        kind = "mixed" if prompt and decodes else "prefill-only" if prompt else "decode-only"
        entry = steps[kind]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += prompt + decodes
        return logits

    runner.execute = timed
    new_tokens = 128 if args.task == "batch" else 64
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    total = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    print(f"{args.task}: {len(prompts)} prompts, {produced} tokens in {total:.2f} s ({produced / total:.1f} tok/s)")
    for kind in ("prefill-only", "mixed", "decode-only"):
        if kind in steps:
            count, seconds, tokens = steps[kind]
            print(f"  {kind:12s} {count:4d} steps  {seconds:6.2f} s  {tokens:6d} tokens  {seconds / count * 1e3:7.1f} ms/step")
    print(f"  outside the model steps: {total - sum(s[1] for s in steps.values()):.2f} s")


if __name__ == "__main__":
    main()
