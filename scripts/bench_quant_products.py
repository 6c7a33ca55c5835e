"""The int8, int4 and packed bf16 products at SmolLM2-1.7B's Linear shapes: milliseconds and GFLOP/s.

    .venv/bin/python scripts/bench_quant_products.py [--threads 2] [--rows 1,16,512] [--repeats 5] [--float32]

Each shape's weights are random (speed does not depend on the values), built once, and run for each
row count on the kernels of the level this process runs (PAGECLI_CPU_ISA picks it). With one
layer's weights at a time the smaller shapes stay in cache at 1-16 rows, so those rows show the
kernel's compute rate, not the memory's (decode speed is bench_shapes.py's tg128). Best of
--repeats calls after one warm-up. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagecli import native
from pagecli.models.quantize import quantize_int8
from pagecli.models.quantize_int4 import quantize_int4

SHAPES = [(6144, 2048, "q, k, v"), (16384, 2048, "gate, up"), (2048, 8192, "down"), (2048, 2048, "o")]


def best_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Float32Product:
    """PyTorch's float32 product (oneDNN/MKL), what float32 models ran before F32PanelLinear."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--float32", action="store_true",
                    help="float32 activations, as float32 models run (the avx2 level's default): int8 and int4 "
                         "round them to int16 (the avx2 kernels), bf16 is F32PanelLinear (weights kept in bf16), f32 is PyTorch's "
                         "float32 product")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.cpu_ops()
    kind, kind4 = ops.int8_linear_kind(), ops.int4_linear_kind()
    bf16 = ops.has_bf16_weight_linear() if args.float32 else ops.has_packed_linear()
    print(f"level {native.level()}, int8 kernel {kind or 'none'}, int4 kernel {kind4 or 'none'}, "
          f"packed bf16 GEMM {'yes' if bf16 else 'no'}, {args.threads} threads")
    gen = torch.Generator().manual_seed(0)
    for n, k, what in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        q, scale = quantize_int8(w)
        int8 = ops.PackedLinearInt8(q, scale, None, int16_activations=args.float32) if kind else None
        int4 = ops.PackedLinearInt4(*quantize_int4(w), None, int16_activations=args.float32) if kind4 else None
        if args.float32:
            w32 = w.bfloat16().float()
            packed = ops.F32PanelLinear(w32, None) if bf16 else None
            torch_f32 = Float32Product(w32)
        else:
            packed = ops.PackedLinear(w.bfloat16(), None) if bf16 else None
            torch_f32 = None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            x = x if args.float32 else x.bfloat16()
            flops = 2 * m * n * k
            cells = []
            for name, layer in (("int8", int8), ("int4", int4), ("bf16", packed), ("f32", torch_f32)):
                if layer is not None:
                    s = best_s(lambda layer=layer: layer.forward(x), args.repeats)
                    cells.append(f"{name} {s * 1e3:7.2f} ms {flops / s / 1e9:4.0f} GFLOP/s")
            print(f"{what:9} [{n:5}, {k:4}] {m:4} rows: " + "   ".join(cells))


if __name__ == "__main__":
    main()
