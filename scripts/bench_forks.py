"""Parallel sampling (n > 1) on the embedded model: time to first token, and output tokens/s.

ttft: one n=N request against n=1 on the same prompt, alternating, prefix caching and the disk
store off (every repetition prefills); issue 27's target is a ratio <= 1.2.
throughput: P prompts x n=N x T tokens as P forked requests, against the same P*N sequences sent
as separate requests with prefix caching on (disk store off). Usage:
    .venv/bin/python scripts/bench_forks.py ttft [--threads 2] [--reps 7] [--prompt-tokens 512] [--n 8]
    .venv/bin/python scripts/bench_forks.py throughput [--threads 2] [--prompts 16] [--n 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

TEXT = "Paged attention keeps the KV cache in fixed-size blocks, shared by reference count. " * 64


def ttft_s(engine: Engine, prompt: list[int], n: int) -> float:
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=1, ignore_eos=True, n=n))
    return min(ev.ttft_s for ev in engine.stream() if ev.ttft_s is not None)


def run_ttft(args: argparse.Namespace) -> None:
    engine = Engine(config=EngineConfig(threads=args.threads, enable_prefix_caching=False, disk_cache=False))
    prompt = engine.encode(TEXT)[: args.prompt_tokens]
    ttft_s(engine, prompt, 1)  # warm-up
    times: dict[int, list[float]] = {1: [], args.n: []}
    for _ in range(args.reps):
        for n in (1, args.n):
            times[n].append(ttft_s(engine, prompt, n))
    for n, values in times.items():
        print(f"n={n}: TTFT median {statistics.median(values) * 1e3:.1f} ms "
              f"(range {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}, {len(values)} runs)")
    ratio = statistics.median(times[args.n]) / statistics.median(times[1])
    print(f"ratio n={args.n} / n=1: {ratio:.2f} ({len(prompt)} prompt tokens, {args.threads} threads)")


def output_tok_s(engine: Engine, prompts: list[list[int]], n: int, copies: int, max_tokens: int) -> tuple[float, int]:
    """Output tokens/s and peak active blocks for each prompt sent `copies` times with n candidates each."""
    for i, prompt in enumerate(prompts):
        for copy in range(copies):
            engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i * 1000 + copy, max_tokens=max_tokens,
                                                      ignore_eos=True, n=n))
    start, tokens, peak = time.perf_counter(), 0, 0
    while engine.has_unfinished:
        tokens += sum(len(ev.token_ids) for ev in engine.step())
        peak = max(peak, engine.pool.counts().active)
    return tokens / (time.perf_counter() - start), peak


def run_throughput(args: argparse.Namespace) -> None:
    config = EngineConfig(threads=args.threads, disk_cache=False, max_num_seqs=args.prompts * args.n)
    engine = Engine(config=config)
    base = engine.encode(TEXT)
    prompts = [engine.encode(f"Question {i}: ") + base[: args.prompt_tokens] for i in range(args.prompts)]
    output_tok_s(engine, prompts[:1], 1, 1, 2)  # warm-up
    forked, forked_peak = output_tok_s(engine, prompts, args.n, 1, args.max_tokens)
    separate, separate_peak = output_tok_s(engine, prompts, 1, args.n, args.max_tokens)
    print(f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, {args.threads} threads: "
          f"forked {forked:.1f} tok/s (peak {forked_peak} blocks), separate requests with prefix caching "
          f"{separate:.1f} tok/s (peak {separate_peak} blocks); ratio {forked / separate:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("ttft", "throughput"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    run_ttft(args) if args.what == "ttft" else run_throughput(args)


if __name__ == "__main__":
    main()
