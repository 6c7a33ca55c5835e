"""Two builds of pagecli's CPU kernels side by side: the sampler and the greedy choice of each on the same
logits and words, alternating (a kernel change measured against the build before it, in one process).

    .venv/bin/python scripts/ab_native_builds.py OLD_KEY NEW_KEY [--threads 1] [--reps 15]

OLD_KEY and NEW_KEY name folders of ~/.cache/pagecli/native (a build's key: the folder a checkout's
`python -m pagecli.native` prints). 64 rows of SmolLM2's 49,152-token vocabulary, flat, peaked and
language-model-like, at the shipped sampling, llama.cpp's default chain and greedy (`greedy_tokens`, on logits
rewritten just before each call, as the output layer leaves them); ms per call, median [range].
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import random
import statistics
import time

import torch


def load(key: str):
    libraries = glob.glob(os.path.expanduser(f"~/.cache/pagecli/native/{key}/*.so"))
    if not libraries:
        raise SystemExit(f"no built kernels under ~/.cache/pagecli/native/{key}")
    spec = importlib.util.spec_from_file_location(f"pagecli_cpu_ops_{key}", libraries[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    builds = {"old": load(args.old), "new": load(args.new)}
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 49152
    settings = {"shipped 0.7/0.95": (0.7, 0, 0.95, 0.0), "llama.cpp chain": (0.8, 40, 0.95, 0.05)}
    rng = random.Random(1)
    for case, scale in (("flat", 0.5), ("peaked", 3.0), ("lm-like", 8.0)):
        logits = torch.randn(rows, vocab, generator=gen) * scale
        times_greedy: dict[str, list[float]] = {"old": [], "new": []}
        for rep in range(args.reps):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                logits.add_(0.0)  # written just now, as by the output layer
                start = time.perf_counter()
                builds[name].greedy_tokens(logits)
                times_greedy[name].append((time.perf_counter() - start) * 1e3)
        print(f"{case:8} {'greedy':17} " + "  ".join(
            f"{name} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for name, v in times_greedy.items()),
            flush=True)
        for label, (t, k, p, m) in settings.items():
            times: dict[str, list[float]] = {"old": [], "new": []}
            for rep in range(args.reps):
                words = [rng.getrandbits(64) for _ in range(rows)]
                for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                    start = time.perf_counter()
                    builds[name].sample_rows(logits, [t] * rows, [k] * rows, [p] * rows, [m] * rows, words)
                    times[name].append((time.perf_counter() - start) * 1e3)
            print(f"{case:8} {label:17} " + "  ".join(
                f"{name} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for name, v in times.items()),
                flush=True)


if __name__ == "__main__":
    main()
