"""Times alternative tiles (rows, tokens per step, warps, pipeline stages, decode splits) of pagecli's
Triton attention kernels on a real NVIDIA GPU, against the tiles the launchers choose today.

    python scripts/gpu_tile_sweep.py [--kind prefill,decode] [--jobs 12] [--json FILE]

Every configuration is first compiled by --jobs worker processes (each runs its share once, filling
Triton's on-disk cache), then timed here with triton.testing.do_bench (median). Each configuration's
output is checked against the default tiles' output on the same inputs (bf16 tolerance); one that
differs is marked WRONG and never ranked. Prints one table per shape, fastest first, with the default
marked, and the speed-up of the best over the default. Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_kernel_bench  # noqa: E402
from gpu_kernel_bench import bench, paged_cache  # noqa: E402
from gpu_roofline import LLAMA2_7B, LLAMA3_8B, SMOLLM2  # noqa: E402

PREFILL_SHAPES = [  # (model, new tokens, prefix tokens)
    (SMOLLM2, 2048, 0), (LLAMA3_8B, 4096, 0), (LLAMA2_7B, 256, 3840),
]
DECODE_SHAPES = [  # (model, batch, context)
    (LLAMA2_7B, 1, 4096), (SMOLLM2, 1, 1024), (SMOLLM2, 64, 1024), (LLAMA3_8B, 32, 2048),
]


def prefill_configs():
    from pagecli.kernels.prefill import PrefillTiles

    yield None  # the default
    for m, n, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        yield PrefillTiles(m, n, w, s)


def decode_configs():
    from pagecli.kernels.decode import DecodeTiles

    yield None, None
    for n, w, s in itertools.product((32, 64), (4, 8), (2, 3, 4)):
        for splits in (None, "half", "double"):
            yield DecodeTiles(n, w, s), splits


def prefill_case(shape, seed=0):
    from pagecli.kernels import paged_prefill_attention

    m, new, prefix = shape
    torch.manual_seed(seed)
    k, v, table = paged_cache(m, [new + prefix])
    q = torch.randn(new, m.num_heads, m.head_dim, device=gpu_kernel_bench.DEVICE, dtype=torch.bfloat16)
    starts = torch.tensor([0, new], dtype=torch.int32, device=gpu_kernel_bench.DEVICE)
    lens = torch.tensor([new + prefix], dtype=torch.int32, device=gpu_kernel_bench.DEVICE)
    return lambda tiles: paged_prefill_attention(q, k, v, table, starts, lens, m.head_dim**-0.5, new, tiles=tiles)


def decode_case(shape, seed=0):
    from pagecli.kernels import paged_decode_attention
    from pagecli.kernels.decode import MAX_SPLITS, choose_num_splits

    m, batch, context = shape
    torch.manual_seed(seed)
    k, v, table = paged_cache(m, [context] * batch)
    q = torch.randn(batch, m.num_heads, m.head_dim, device=gpu_kernel_bench.DEVICE, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=gpu_kernel_bench.DEVICE)
    auto = choose_num_splits(batch, m.num_kv_heads, q.device)

    def run(config):
        tiles, splits = config
        n = {None: auto, "half": max(1, auto // 2), "double": min(MAX_SPLITS, auto * 2)}[splits]
        return paged_decode_attention(q, k, v, table, lens, m.head_dim**-0.5, num_splits=n, tiles=tiles)

    return run, auto


def cases(kind):
    if kind == "prefill":
        return [(f"prefill {m.name}: {new} new on {prefix} prefix", prefill_case((m, new, prefix)))
                for m, new, prefix in PREFILL_SHAPES], list(prefill_configs())
    made = []
    for m, batch, context in DECODE_SHAPES:
        run, auto = decode_case((m, batch, context))
        made.append((f"decode {m.name}: batch {batch}, context {context} (auto splits {auto})", run))
    return made, list(decode_configs())


def describe(kind, config):
    if kind == "prefill":
        if config is None:
            return "default"
        return f"m={config.block_m} n={config.block_n} w{config.num_warps} s{config.num_stages}"
    tiles, splits = config
    if tiles is None:
        return "default"
    return f"n={tiles.block_n} w{tiles.num_warps} s{tiles.num_stages} splits={splits or 'auto'}"


def compile_share(kind: str, index: int, count: int) -> None:
    """Worker: runs configurations index, index + count, ... once each, so Triton compiles and caches them."""
    made, configs = cases(kind)
    for _, run in made:
        for config in configs[index::count]:
            try:
                run(config)
            except Exception as exc:  # a tile that does not fit is reported by the timing pass
                print(f"worker {index}: {describe(kind, config)}: {type(exc).__name__}", file=sys.stderr)
    torch.cuda.synchronize()


def sweep(kind: str, jobs: int, reps: int) -> list[dict]:
    started = time.time()
    workers = [subprocess.Popen([sys.executable, __file__, "--compile-share", f"{kind}:{i}:{jobs}"])
               for i in range(jobs)]
    for w in workers:
        w.wait()
    print(f"{kind}: compiled in {time.time() - started:.0f} s by {jobs} processes", flush=True)
    made, configs = cases(kind)
    rows = []
    for label, run in made:
        expected = run(configs[0]).float()
        results = []
        for config in configs:
            try:
                got = run(config).float()
                ok = torch.allclose(got, expected, atol=2e-2, rtol=2e-2)
                us = bench(lambda: run(config), reps)
            except Exception as exc:
                results.append(dict(config=describe(kind, config), error=f"{type(exc).__name__}: {str(exc)[:80]}"))
                continue
            results.append(dict(config=describe(kind, config), us=us, ok=ok))
        default_us = results[0].get("us")
        ranked = sorted((r for r in results if r.get("ok")), key=lambda r: r["us"])
        print(f"\n{label}: default {default_us:.1f} µs, best {ranked[0]['config']} {ranked[0]['us']:.1f} µs "
              f"({default_us / ranked[0]['us']:.2f}x)")
        for r in ranked[:8]:
            print(f"  {r['us']:8.1f} µs  {r['config']}")
        for r in results:
            if "error" in r or not r.get("ok"):
                print(f"  {'WRONG' if 'error' not in r else 'ERROR'}  {r['config']}  {r.get('error', '')}")
        rows.append(dict(shape=label, results=results))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="prefill,decode")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--reps", type=int, default=50, help="milliseconds of timed repetitions per configuration")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-share", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_tile_sweep: needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2
    if args.compile_share:
        kind, index, count = args.compile_share.split(":")
        compile_share(kind, int(index), int(count))
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    out = {kind: sweep(kind, args.jobs, args.reps) for kind in args.kind.split(",")}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
