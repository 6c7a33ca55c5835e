"""The output layer's product with the greedy choice taken inside it (forward_choosing) against the product and
then greedy_tokens' pass over its logits, alternating, on random weights of a model's output-layer shape.

    .venv/bin/python scripts/bench_greedy_in_output.py [--hidden 64,576] [--rows 1,64,256] [--reps 21] [--threads 1]

Forms: float-panels (float32 model, bf16-exact weights), bf16-panels where the build has the packed GEMM, and a
GGUF Q8_0 output as it lies (float32 activations, the AVX2 int8 kernel). Vocabulary 49,152 (the embedded model's).
Prints per form, hidden size and rows the median and range of both ways in ms, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagecli import native
from pagecli.doctor import cpu_model

VOCAB = 49152


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = weight.view(weight.shape[0], -1, 32)  # [N, K / 32, 32]
    scale = (blocks.abs().amax(dim=2) / 127).to(torch.float16)  # [N, K / 32]
    q = (blocks / scale.float().clamp_min(1e-8).unsqueeze(2)).round().clamp(-127, 127).to(torch.int8)
    return q.view_as(weight).contiguous(), scale


def forms(ops, hidden: int) -> dict[str, tuple[object, torch.dtype]]:
    weight = (torch.randn(VOCAB, hidden) * 0.05).bfloat16().float()  # [vocab, hidden], bf16-exact as checkpoints are
    out = {"float-panels": (ops.F32PanelLinear(weight, None), torch.float32)}
    if ops.has_packed_linear():
        out["bf16-panels"] = (ops.PackedLinear(weight.bfloat16(), None), torch.bfloat16)
    if ops.int8_linear_kind():
        out["Q8_0"] = (ops.PackedLinearInt8(*q8_0_blocks(weight), None, int16_activations=True), torch.float32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="64,576")
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.cpu_ops()
    print(f"CPU: {cpu_model()}; pagecli.native level {native.level()}; {args.threads} thread(s); vocab {VOCAB}; "
          f"medians of {args.reps} alternating reps, ms (range)")
    print(f"{'form':14s} {'hidden':>6s} {'rows':>5s} {'product + pass':>22s} {'choice inside':>22s} {'ratio':>6s}")
    for hidden in (int(h) for h in args.hidden.split(",")):
        for name, (product, dtype) in forms(ops, hidden).items():
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, hidden).to(dtype)  # [rows, hidden]
                apart, inside = [], []
                ways = [(apart, lambda: ops.greedy_tokens(product.forward(x))),
                        (inside, lambda: product.forward_choosing(x))]
                for rep in range(args.reps + 1):
                    for times, way in ways if rep % 2 else ways[::-1]:  # each goes first every other rep
                        start = time.perf_counter()
                        way()
                        if rep:  # the first of each is a warm-up
                            times.append((time.perf_counter() - start) * 1e3)
                a, b = statistics.median(apart), statistics.median(inside)
                print(f"{name:14s} {hidden:6d} {rows:5d} {a:8.3f} ({min(apart):.3f}-{max(apart):.3f}) "
                      f"{b:8.3f} ({min(inside):.3f}-{max(inside):.3f}) {b / a:6.2f}", flush=True)


if __name__ == "__main__":
    main()
