"""Where one mixture-of-experts layer's decode time goes, at OLMoE-1B-7B's shape (hidden 2048, 64 experts of
width 1024, 8 per token) with random int4 experts (--quantize int4's form), one token:

    .venv/bin/python scripts/profile_moe_layer.py [--threads 1] [--reps 200]

Prints medians over --reps calls (three rounds, the median round): the whole layer (SparseMoE.forward), its
router, the token's 8 chosen experts called one after another without routing (distinct weights: read from
memory), one expert called again and again (its weights in cache) split into gate/up, SiLU*up and down, and
the gate/up product cycling through all 64 experts (never cached) with the bytes per second it streams. The
layer minus the chosen experts' loop is what routing, Python and dispatch cost; the cached and uncached
products show how much of a product is reading its weights from memory. Name the CPU, threads and load beside
any figure (the script prints lscpu's model and the load average).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch


def median_us(call: Callable[[], object], reps: int) -> float:
    call()
    rounds = []
    for _ in range(3):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rounds.append(statistics.median(times))
    return statistics.median(rounds) * 1e6


def build_layer():
    from transformers import OlmoeConfig

    from pagecli import native
    from pagecli.models.moe import SparseMoE
    from pagecli.models.spec import DecoderSpec
    from pagecli.models.weight_forms import WeightPlacer
    from pagecli.models.weight_plan import plan_weights

    config = OlmoeConfig(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                         num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304)
    ops = native.cpu_ops()
    plan = plan_weights(torch.float32, torch.device("cpu"), "int4", ops)
    torch.manual_seed(0)
    moe = SparseMoE(DecoderSpec.from_hf_config(config, "olmoe-1b-7b shape"))
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.02)
    moe.fuse_projections()
    placer = WeightPlacer(plan, ops)
    for expert in moe.experts:
        placer._quantize(expert.gate_up_proj, "int4")
        placer._quantize(expert.down_proj, "int4")
        expert.kernel = ops.silu_mul
    return moe, ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")),
        platform.processor())
    moe, ops = build_layer()
    x = torch.randn(1, 2048)  # [1 token, hidden]
    with torch.no_grad():
        _, chosen = moe.route(x)
        picked = chosen[0].tolist()
        expert = moe.experts[picked[0]]
        gate_up = expert.gate_up_proj(x)  # [1, 2 * 1024]
        hidden = ops.silu_mul(gate_up)  # [1, 1024]
        layer = median_us(lambda: moe(x), args.reps)
        router = median_us(lambda: moe.route(x), args.reps)
        chosen_loop = median_us(lambda: [moe.experts[i](x) for i in picked], args.reps)
        cached_gate_up = median_us(lambda: expert.gate_up_proj(x), args.reps)
        cached_act = median_us(lambda: ops.silu_mul(gate_up), args.reps)
        cached_down = median_us(lambda: expert.down_proj(hidden), args.reps)
        cycle = median_us(lambda: [e.gate_up_proj(x) for e in moe.experts], max(3, args.reps // 50)) / 64
    gate_up_bytes = sum(p.numel() * p.element_size() for p in expert.gate_up_proj.parameters())
    print(f"CPU: {cpu}; threads {args.threads}; load average {os.getloadavg()[0]:.1f}")
    print(f"layer (1 token, 8 of 64 experts): {layer:.0f} us; router {router:.0f} us")
    print(f"the 8 chosen experts called in a loop: {chosen_loop:.0f} us "
          f"(routing, Python and dispatch: {layer - chosen_loop:.0f} us, {(layer - chosen_loop) / layer:.0%})")
    print(f"one expert, cached: gate/up {cached_gate_up:.0f} + silu_mul {cached_act:.0f} + down {cached_down:.0f} us")
    print(f"gate/up cycling through 64 experts (uncached): {cycle:.0f} us each, "
          f"{gate_up_bytes / cycle / 1e3:.1f} GB/s of its {gate_up_bytes / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
