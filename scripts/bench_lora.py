"""LoRA adapters on the embedded model: one batch mixing adapters against the base alone and against the
adapters run one after another, merged into their weights.

Three ways to run P prompts x T output tokens (greedy, EOS ignored), prefix caching and the disk store off,
every engine on --threads threads:
- base: every prompt on the base model (pagecli's base fast paths, the native one-call decode step included);
- mixed: the same batch, prompt i on adapter i mod (A + 1) (the last share on the base), one engine;
- merged: each adapter merged into the weights (`--merge-lora`, its own engine) and its share of the prompts
  run there, the base's share on the base, one after another; engines are built before the clock starts, so
  its figure is decode and prefill only, no loading.
Adapters are random (PEFT's layout, B not zero) of rank --rank over q/k/v/o and the MLP. --quantize applies to
base and mixed (merging needs float weights: the merged engines and the base's share there run `none`). Output
tokens/s is output tokens over the wall time of the whole batch, after a warm-up; --reps R alternates the three
R times and prints medians with their ranges. Usage:
    .venv/bin/python scripts/bench_lora.py [--threads 2] [--prompts 64] [--adapters 8] [--rank 8]
        [--max-tokens 64] [--reps 3] [--quantize none|auto]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_helpers import make_adapter  # noqa: E402  (the tests' random PEFT adapters)

TOPICS = ["the sea", "a library", "trains", "winter", "bread", "clocks", "rivers", "maps", "bees", "glass",
          "mountains", "paper", "lamps", "gardens", "bridges", "salt"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def prompts_for(engine: Engine, count: int, round_index: int) -> list[list[int]]:
    return [engine.encode([{"role": "user", "content": f"Round {round_index}: write about {TOPICS[i % len(TOPICS)]}, "
                                                       f"note {i}."}]) for i in range(count)]


def run_batch(engine: Engine, jobs: list[tuple[list[int], str | None]], max_tokens: int) -> int:
    """Queue every job, run the engine dry; returns output tokens."""
    for ids, lora in jobs:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=lora))
    return sum(len(ev.token_ids) for ev in engine.stream())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quantize", default="none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(threads=args.threads, enable_prefix_caching=False, disk_cache=False, kv_budget_gib=0.5)
    probe = Engine(config=EngineConfig(**common))
    base_folder = probe.loaded.folder
    del probe
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"a{i}" for i in range(args.adapters)]
    adapters = {name: make_adapter(base_folder, work / name, rank=args.rank, seed=i, b_scale=0.05)
                for i, name in enumerate(names)}
    mixed = Engine(config=EngineConfig(**common, quantize=args.quantize, max_loras=args.adapters,
                                       loras=tuple((n, str(p)) for n, p in adapters.items())))
    plain = Engine(config=EngineConfig(**common, quantize="none"))
    merged = {name: Engine(config=EngineConfig(**common, quantize="none", loras=((name, str(folder)),),
                                               merge_lora=True)) for name, folder in adapters.items()}
    choices = [*names, None]

    def jobs(round_index: int) -> list[tuple[list[int], str | None]]:
        return [(ids, choices[i % len(choices)]) for i, ids in enumerate(prompts_for(mixed, args.prompts, round_index))]

    def base_only(round_index: int) -> int:
        return run_batch(mixed, [(ids, None) for ids, _ in jobs(round_index)], args.max_tokens)

    def mixed_batch(round_index: int) -> int:
        return run_batch(mixed, jobs(round_index), args.max_tokens)

    def merged_in_turn(round_index: int) -> int:
        work_items = jobs(round_index)
        tokens = 0
        for name in choices:
            engine = plain if name is None else merged[name]
            tokens += run_batch(engine, [(ids, None) for ids, lora in work_items if lora == name], args.max_tokens)
        return tokens

    ways = {"base": base_only, "mixed": mixed_batch, "merged": merged_in_turn}
    for run in ways.values():
        run(-1)  # warm-up: loads the adapters, touches the pools
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(args.reps):
        for name, run in ways.items():
            start = time.perf_counter()
            tokens = run(round_index)
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"round {round_index + 1} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    print(f"{cpu_name()}; {args.threads} threads; embedded SmolLM2-135M ({mixed.plan.summary()} for base and "
          f"mixed, float32 merged); {args.prompts} prompts x {args.max_tokens} tokens; {args.adapters} adapters of "
          f"rank {args.rank} (q/k/v/o + MLP) and the base; {args.reps} alternating rounds")
    for name, values in rates.items():
        print(f"{name:>7}: {statistics.median(values):8.1f} tok/s (range {min(values):.1f}-{max(values):.1f})")
    base, mix, merge = (statistics.median(rates[n]) for n in ("base", "mixed", "merged"))
    print(f"mixed / base: {mix / base:.2f} (target >= 0.8); mixed / merged one after another: {mix / merge:.2f} "
          "(target >= 1.5)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
