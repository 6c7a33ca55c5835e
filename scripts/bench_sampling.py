"""What sampling costs: the sampler alone on a 64-row step, and whole runs at the shipped sampling beside greedy.

    .venv/bin/python scripts/bench_sampling.py [--only kernel,engine] [--threads 2] [--repeats 5]

kernel: pagecli's CPU sampling kernel (native/sampling.cpp) on 64 rows of SmolLM2's 49,152-token vocabulary,
flat (a random-weight model's logits: top-p keeps most of the vocabulary), peaked and language-model-like
rows, at the shipped profile's sampling (temperature 0.7, top_p 0.95), llama.cpp's default chain (top_k 40,
top_p 0.95, min_p 0.05, temperature 0.8) and greedy (the argmax kernel); milliseconds per step, median and
range of the repetitions.

engine: the embedded model with the defaults a user gets (dtype and --quantize auto), 64 prompts x 128
tokens and one prompt x 256 tokens (ignore_eos), greedy and at the shipped sampling in alternating
repetitions in one process: output tokens per second, median [range], and the ratio sampled / greedy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.native import cpu_ops

VOCAB = 49152
ROWS = 64
SHIPPED = dict(temperature=0.7, top_p=0.95)
LLAMA_CPP_CHAIN = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
TOPICS = ["the sea", "a library", "trains", "winter", "bread", "bees", "maps", "a garden"]


def story_prompts(count: int, label: str = "") -> list[list[dict[str, str]]]:
    """The engine runs' chat prompts, a short story each; a label (", round 2") makes a set of prompts of its own."""
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i}{label})."}]
            for i in range(count)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def bench_kernel(repeats: int) -> None:
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("pagecli's CPU kernels are not available here (python -m pagecli.native says why)")
    gen = torch.Generator().manual_seed(0)
    rows = {name: torch.randn(ROWS, VOCAB, generator=gen) * scale
            for name, scale in (("flat", 0.5), ("peaked", 3.0), ("lm-like", 8.0))}
    print(f"sampler alone, {ROWS} x {VOCAB} float32 logits, {torch.get_num_threads()} threads: ms per step")
    for name, logits in rows.items():
        times: dict[str, list[float]] = {"shipped 0.7/0.95": [], "llama.cpp chain": [], "greedy": []}
        for r in range(repeats):
            for label, params in (("shipped 0.7/0.95", SHIPPED), ("llama.cpp chain", LLAMA_CPP_CHAIN)):
                p = SamplingParams(**params)
                words = [torch.randint(0, 2**62, (), generator=gen).item() for _ in range(ROWS)]
                start = time.perf_counter()
                ops.sample_rows(logits, [p.temperature] * ROWS, [p.top_k] * ROWS, [p.top_p] * ROWS,
                                [p.min_p] * ROWS, words)
                times[label].append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            ops.greedy_tokens(logits)
            times["greedy"].append((time.perf_counter() - start) * 1e3)
        print(f"  {name:8s} " + "   ".join(f"{label} {spread(t)}" for label, t in times.items()))


def bench_engine(repeats: int) -> None:
    from pagecli.engine import Engine
    from pagecli.models.source import prepare_default_model

    engine = Engine(str(prepare_default_model()), EngineConfig())
    print(f"engine: embedded model, dtype {engine.loaded.dtype}, quantize {engine.quantize}, "
          f"{torch.get_num_threads()} threads")
    prompts = story_prompts(64)
    for label, count, tokens in (("64 prompts x 128", 64, 128), ("1 prompt x 256", 1, 256)):
        rates: dict[str, list[float]] = {"greedy": [], "shipped 0.7/0.95": []}
        for r in range(repeats):
            for name, params in (("greedy", dict(temperature=0)), ("shipped 0.7/0.95", dict(SHIPPED, seed=r))):
                sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, **params)
                start = time.perf_counter()
                done = engine.generate(prompts[:count], sampling)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(c.completion_tokens for c in done) / elapsed)
        ratio = statistics.median(rates["shipped 0.7/0.95"]) / statistics.median(rates["greedy"])
        print(f"  {label}: " + "   ".join(f"{name} {spread(r)} tok/s" for name, r in rates.items())
              + f"   sampled/greedy {ratio:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="kernel,engine")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.only.split(",")
    if "kernel" in parts:
        bench_kernel(args.repeats)
    if "engine" in parts:
        bench_engine(args.repeats)


if __name__ == "__main__":
    main()
