"""`pagecli generate --ray` against one process on this machine, embedded model, whole CLI runs.

batch: 64 `mixed` prompts x 128 output tokens (ignore_eos, greedy), 2 Ray workers x 1 thread against one
process x 2 threads. Reports each run's generation tok/s (the summary line: model load and Ray start
excluded) and the whole command's wall time, medians of alternating repetitions with the range.
shared-prefix: the 32-request shared-prefix workload (one ~600-token system prompt); the prefix hit rate
of 2 workers against one process, disk store off so every run starts cold (issue 20's target: >= 90%).
Usage:
    .venv/bin/python scripts/bench_ray.py [batch|shared-prefix|both] [--reps 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagecli.bench.workloads import builtin_workload
from pagecli.config import SamplingParams

SETUPS = {
    "1 process x 2 threads": ["--threads", "2"],
    "2 Ray workers x 1 thread": ["--ray", "--workers", "2", "--threads-per-worker", "1"],
}
COMMON = ["-t", "0", "--ignore-eos", "--no-disk-cache", "--no-progress"]
DONE = re.compile(r"\(([\d.]+) tok/s\).*prefix cache served (\d+)% of prompt tokens")


def write_workload(name: str, count: int, max_tokens: int | None, path: Path) -> None:
    workload = builtin_workload(name, SamplingParams(temperature=0.0), count=count, max_tokens=max_tokens)
    with path.open("w") as out:
        for request in workload.requests:
            key = "prompt" if isinstance(request.prompt, str) else "messages"
            prompt = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
            out.write(json.dumps({key: prompt, "max_tokens": request.sampling.max_tokens}) + "\n")


def run_once(src: Path, folder: Path, flags: list[str]) -> dict[str, float]:
    dst = folder / f"out-{time.monotonic_ns()}.jsonl"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pagecli", "generate", str(src), "-o", str(dst), *COMMON, *flags],
                          capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pagecli failed ({done.returncode}): {done.stderr[-2000:]}")
    match = DONE.search(done.stderr)
    if match is None:
        raise SystemExit(f"no summary line in: {done.stderr[-2000:]}")
    return {"tok_s": float(match.group(1)), "prefix_hit": int(match.group(2)) / 100, "wall_s": wall_s}


def compare(src: Path, folder: Path, reps: int) -> dict[str, dict[str, list[float]]]:
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in SETUPS}
    for _ in range(reps):  # alternating, so drift on a shared machine hits both alike
        for name, flags in SETUPS.items():
            for key, value in run_once(src, folder, flags).items():
                runs[name].setdefault(key, []).append(value)
    return runs


def describe(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} (range {min(values):.3g}-{max(values):.3g}, {len(values)} runs)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("which", nargs="?", default="both", choices=["batch", "shared-prefix", "both"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.which in ("batch", "both"):
            write_workload("mixed", 64, 128, folder / "batch.jsonl")
            results["batch"] = compare(folder / "batch.jsonl", folder, args.reps)
        if args.which in ("shared-prefix", "both"):
            write_workload("shared-prefix", 32, None, folder / "shared.jsonl")
            results["shared-prefix"] = compare(folder / "shared.jsonl", folder, args.reps)
    for workload, runs in results.items():
        print(f"{workload}:")
        for name, figures in runs.items():
            print(f"  {name}: generation tok/s {describe(figures['tok_s'])}; prefix hit "
                  f"{describe(figures['prefix_hit'])}; whole command {describe(figures['wall_s'])} s")
        single, ray = (statistics.median(runs[n]["tok_s"]) for n in SETUPS)
        hits_single, hits_ray = (statistics.median(runs[n]["prefix_hit"]) for n in SETUPS)
        print(f"  ray / single: throughput {ray / single:.2f}x; prefix hit rate "
              f"{hits_ray / max(hits_single, 1e-9):.0%} of the single process's")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
