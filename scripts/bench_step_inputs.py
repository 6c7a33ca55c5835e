"""The step's inputs built from kept block tables against rebuilt from lists (issue 44), alternating.

    .venv/bin/python scripts/bench_step_inputs.py [--reps 200]

On the host-probe model (scripts/make_shape_models.py), N sequences are brought to steady decode; then
one step's plan is prepared again and again, alternately by `ModelRunner.prepare` (block tables kept
between steps: engine/block_tables.py) and by `rebuilt_prepare` below, which builds everything from the
sequences' lists as the runner did before (the padded block tables made one tensor each step). Prints
the median and the fastest of each, in ms, for 64 sequences of 16 and 1,000 tokens and 256 of 16.
One thread, under inference mode, as a step runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shape_models import make_model  # noqa: E402

from pagecli.attention import AttentionMetadata  # noqa: E402
from pagecli.config import EngineConfig, SamplingParams  # noqa: E402
from pagecli.doctor import cpu_model  # noqa: E402
from pagecli.engine import Engine  # noqa: E402
from pagecli.models.source import prepare_default_model  # noqa: E402


def rebuilt_prepare(block_size: int, scheduled) -> tuple:
    """Every input from lists, every step: the way before the kept tables."""
    input_ids, positions, slots, query_lens, seq_lens, tables, sample_indices = [], [], [], [], [], [], []
    for item in scheduled:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        input_ids.extend(seq.token_ids[start : start + n])
        positions.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(table)
        if item.samples:
            sample_indices.append(len(input_ids) - 1)
    num_decode = sum(1 for q in query_lens if q == 1)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, num_decode, "cpu")
    return torch.tensor(input_ids), torch.tensor(positions), meta, torch.tensor(sample_indices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = make_model("host-probe", Path.home() / ".cache" / "pagecli-bench" / "models", prepare_default_model())
    print(f"CPU: {cpu_model()}; 1 thread; ms per prepare, median [fastest] of {args.reps} alternations")
    for seqs, context in ((64, 16), (64, 1000), (256, 16)):
        config = EngineConfig(dtype="float32", disk_cache=False, max_num_seqs=seqs, block_size=16,
                              num_blocks=seqs * (context // 16 + 8), max_num_batched_tokens=max(2048, seqs * 16),
                              quantize="none", max_model_len=2048)
        engine = Engine(str(folder), config)
        for i in range(seqs):
            engine.add_request([1000 + (i * 7 + j) % 9000 for j in range(context)],
                               SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
            engine.step()
        engine.step()
        plan = engine.scheduler.schedule()
        times: dict[str, list[float]] = {"kept": [], "rebuilt": []}
        with torch.inference_mode():
            for rep in range(args.reps):
                for name in ("kept", "rebuilt") if rep % 2 else ("rebuilt", "kept"):
                    start = time.perf_counter()
                    if name == "kept":
                        engine.runner.prepare(plan.scheduled)
                    else:
                        rebuilt_prepare(engine.runner.block_size, plan.scheduled)
                    times[name].append((time.perf_counter() - start) * 1e3)
        print(f"{seqs:4d} sequences of {context:5d} tokens: " + "   ".join(
            f"{name} {statistics.median(v):.3f} [{min(v):.3f}]" for name, v in times.items()), flush=True)
        engine.close()


if __name__ == "__main__":
    main()
