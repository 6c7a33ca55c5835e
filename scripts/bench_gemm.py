"""The packed bf16 GEMM (gemm_bf16.cpp) on SmolLM2-135M's weights, against the products it could replace.

    .venv/bin/python scripts/bench_gemm.py [--threads 2] [--repeats 7] [--rows 1,2,4,8,16,32,64,128,256]
        [--model DIR]

For each row count, one pass over every projection of the 30 layers and the 49,152-row output layer
(269 MB of bf16; --model: another model's, e.g. scripts/make_shape_models.py's 1.7B shape) with: F.linear (oneDNN), linear_bf16_rows (up to 16 rows) and linear_bf16_packed
on weights packed once; and a plain read of the same bytes (the native read_probe, one pass on every
thread: the memory floor; torch's sum read at about two thirds of its speed on Zen 4). The
kinds take turns within each repetition, so a change in the machine's speed between minutes hits
them alike; printed: the median ms with [min-max], and GFLOP/s (2 * rows * parameters per pass).
For the packed kernel: its share of the bf16 peak, assuming one 512-bit vdpbf16ps per cycle per
core (Zen 4: 32 bf16 multiply-adds) at --ghz (what matters from about 16 rows), and of the read
speed (what matters up to about 8 rows; the read is one pass over one tensor, the products are
121 calls). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pagecli.config import EngineConfig
from pagecli.engine import Engine

FLOP_PER_CYCLE = 64  # one vdpbf16ps zmm per cycle: 16 lanes x 2 products x (multiply + add)


def pass_ms(fn: Callable[[], object], min_s: float = 0.05) -> float:
    """Mean ms of fn over enough back-to-back calls to last min_s (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls * 1e3


def summary(times_ms: list[float], flop: float | None) -> str:
    median = statistics.median(times_ms)
    text = f"{median:7.2f} ms [{min(times_ms):6.2f}-{max(times_ms):6.2f}]"
    return text + (f" {flop / median / 1e6:5.0f} GF/s" if flop else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--ghz", type=float, default=3.5, help="core clock for the peak figure")
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["PAGECLI_PACKED_GEMM"] = "0"  # the row-layout weights are what this script times and packs
    engine = Engine(args.model, EngineConfig(dtype="bfloat16", disk_cache=False, kv_budget_gib=0.25))
    ops = engine.backend.cpu_ops
    if ops is None or not ops.has_packed_linear():
        raise SystemExit("needs pagecli's CPU kernels with AVX512-BF16 (has_packed_linear)")
    model = engine.loaded.model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.output_weight]
    start = time.perf_counter()
    packs = [ops.pack_bf16_weights(w) for w in weights]
    pack_s = time.perf_counter() - start
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    packed_bytes = sum(p.numel() * p.element_size() for p in packs)
    params = sum(w.numel() for w in weights)
    peak = FLOP_PER_CYCLE * args.ghz * args.threads  # GFLOP/s
    flat = torch.cat([w.flatten() for w in weights])  # the same bytes, contiguous
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 32)]).view(torch.int64)  # whole 64-byte lines
    flat = ops.weight_copy(flat)  # in the packed weights' kind of pages
    print(f"threads: {args.threads}; weights {weight_bytes / 1e6:.0f} MB ({len(weights)} matrices), packed "
          f"{packed_bytes / 1e6:.0f} MB in {pack_s:.2f} s; bf16 peak assumed {peak:.0f} GF/s "
          f"({FLOP_PER_CYCLE} flop/cycle/core at {args.ghz} GHz)")

    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}  # [rows, K]
        kinds: dict[str, Callable[[], object]] = {
            "read": lambda: ops.read_probe(flat),
            "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
            "packed": lambda: [ops.linear_bf16_packed(xs[w.shape[1]], p, None, w.shape[0], w.shape[1])
                               for w, p in zip(weights, packs)],
        }
        if rows <= 16:
            kinds["rows kernel"] = lambda: [ops.linear_bf16_rows(xs[w.shape[1]], w, None) for w in weights]
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.repeats):
            for kind, fn in kinds.items():
                times[kind].append(pass_ms(fn))
        flop = 2.0 * rows * params
        packed = statistics.median(times["packed"])
        line = f"{rows:4d} rows: read {summary(times['read'], None)}"
        for kind in ("F.linear", "rows kernel", "packed"):
            if kind in times:
                line += f" | {kind} {summary(times[kind], flop)}"
        line += (f" | packed: {flop / packed / 1e6 / peak:4.0%} of peak, "
                 f"{statistics.median(times['read']) / packed:4.0%} of read speed, "
                 f"{statistics.median(times['F.linear']) / packed:.2f}x as fast as F.linear")
        print(line, flush=True)


if __name__ == "__main__":
    main()
