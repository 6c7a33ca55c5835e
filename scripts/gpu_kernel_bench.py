"""Times pagecli's Triton kernels on a real NVIDIA GPU at the shapes of docs/GPU.md's roofline table.

    python scripts/gpu_kernel_bench.py [--json FILE] [--reps N]

Each row is one layer's call, timed with triton.testing.do_bench (median of its repetitions, after
warm-up): the time, the bytes and FLOPs the roofline counts (scripts/gpu_roofline.py), the rate
those give, and the share of the device's peak (bandwidth for a memory-bound call, bf16 tensor
FLOP/s for a compute-bound one). Prefill rows also time PyTorch's own
scaled_dot_product_attention on the same queries with K/V already contiguous (no paging, no
prefix gathering): the flash-attention kernel PyTorch ships, as the figure to be held against.
Afterwards it prints every specialization the run compiled with its registers, spills and shared
memory, to hold against `python -m pagecli.attention.aot --arch 90 --grouped`.
Needs CUDA; prints one line and exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_roofline import LLAMA2_7B, LLAMA3_8B, SMOLLM2, Model, decode_call, prefill_call, store_call  # noqa: E402

BLOCK = 16
DEVICE = "cuda"  # tests of the script itself may point it elsewhere


def peaks(name: str) -> tuple[float, float]:
    """(bytes/s, bf16 FLOP/s) of the device, dense: the datasheet figures for H100/H200 SXM and A100."""
    if "H200" in name:
        return 4.8e12, 989e12
    if "H100" in name:
        return 3.35e12, 989e12
    return 2.0e12, 312e12


def paged_cache(m: Model, seq_lens: list[int], dtype=torch.bfloat16):
    """K/V caches holding every sequence on shuffled blocks, and the block table."""
    need = [-(-n // BLOCK) for n in seq_lens]
    total = sum(need) + 1
    k = torch.randn(total, BLOCK, m.num_kv_heads, m.head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    order = torch.randperm(total, device=DEVICE).to(torch.int32)
    width = max(need)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used : used + n]
        used += n
    return k, v, table


def bench(fn, reps: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median") * 1e3  # microseconds


def decode_row(m: Model, batch: int, context: int, reps: int) -> dict:
    from pagecli.kernels import paged_decode_attention

    k, v, table = paged_cache(m, [context] * batch)
    q = torch.randn(batch, m.num_heads, m.head_dim, device=DEVICE, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    us = bench(lambda: paged_decode_attention(q, k, v, table, lens, m.head_dim**-0.5), reps)
    nbytes, flops = decode_call(m, batch, context)
    return dict(kernel="decode", model=m.name, shape=f"batch {batch}, context {context}", us=us,
                bytes=nbytes, flops=flops)


def prefill_row(m: Model, new: int, prefix: int, reps: int) -> dict:
    from pagecli.kernels import paged_prefill_attention

    total = new + prefix
    k, v, table = paged_cache(m, [total])
    q = torch.randn(new, m.num_heads, m.head_dim, device=DEVICE, dtype=torch.bfloat16)
    starts = torch.tensor([0, new], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([total], dtype=torch.int32, device=DEVICE)
    scale = m.head_dim**-0.5
    us = bench(lambda: paged_prefill_attention(q, k, v, table, starts, lens, scale, new), reps)
    nbytes, flops = prefill_call(m, new, prefix)
    row = dict(kernel="prefill", model=m.name, shape=f"{new} new tokens on a {prefix}-token prefix", us=us,
               bytes=nbytes, flops=flops)
    if prefix == 0:  # SDPA's causal mask is the prefill's only when there is no prefix
        group = m.num_heads // m.num_kv_heads
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, new, d]
        ks = torch.randn(1, m.num_kv_heads, new, m.head_dim, device=DEVICE, dtype=torch.bfloat16)
        ks = ks.repeat_interleave(group, dim=1)
        vs = torch.randn_like(ks)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        row["torch_sdpa_us"] = bench(lambda: sdpa(qs, ks, vs, is_causal=True, scale=scale), reps)
    return row


def store_row(m: Model, tokens: int, reps: int) -> dict:
    from pagecli.kernels import store_kv

    k, v, _ = paged_cache(m, [tokens])
    key = torch.randn(tokens, m.num_kv_heads, m.head_dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(k.shape[0] * BLOCK, device=DEVICE)[:tokens].to(torch.int64)
    us = bench(lambda: store_kv(key, value, k, v, slots), reps)
    nbytes, flops = store_call(m, tokens)
    return dict(kernel="store_kv", model=m.name, shape=f"{tokens} tokens", us=us, bytes=nbytes, flops=flops)


def compiled_kernels() -> list[dict]:
    """Registers, spills and shared memory of every specialization this process compiled."""
    import importlib

    # pagecli.kernels exports functions named like their modules: import the modules themselves.
    decode, prefill, store_module = (importlib.import_module(f"pagecli.kernels.{name}")
                                     for name in ("decode", "prefill", "store_kv"))

    rows = []
    for fn in (decode._decode_kernel, decode._merge_splits_kernel, prefill._prefill_kernel,
               store_module._store_kv_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in cache.values():
                meta = compiled.metadata
                rows.append(dict(kernel=compiled.name, regs=getattr(compiled, "n_regs", None),
                                 spills=getattr(compiled, "n_spills", None),
                                 shared=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    ap.add_argument("--reps", type=int, default=200, help="milliseconds of timed repetitions per row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernel_bench: needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2
    name = torch.cuda.get_device_name()
    bandwidth, peak = peaks(name)
    rows = [
        decode_row(SMOLLM2, 1, 1024, args.reps), decode_row(SMOLLM2, 64, 1024, args.reps),
        decode_row(LLAMA2_7B, 1, 4096, args.reps), decode_row(LLAMA2_7B, 32, 2048, args.reps),
        decode_row(LLAMA3_8B, 32, 2048, args.reps),
        prefill_row(SMOLLM2, 2048, 0, args.reps), prefill_row(LLAMA2_7B, 2048, 0, args.reps),
        prefill_row(LLAMA2_7B, 256, 3840, args.reps), prefill_row(LLAMA3_8B, 8192, 0, args.reps),
        store_row(LLAMA2_7B, 2048, args.reps), store_row(LLAMA2_7B, 32, args.reps),
    ]
    print(f"device: {name}, torch {torch.__version__}, peaks used {bandwidth / 1e12:.2f} TB/s, "
          f"{peak / 1e12:.0f} TFLOP/s bf16")
    print("| kernel | model | shape | µs | floor µs | GB/s | TFLOP/s | % of peak | torch SDPA µs |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        floor = max(r["bytes"] / bandwidth, r["flops"] / peak) * 1e6
        memory_bound = r["bytes"] / bandwidth >= r["flops"] / peak
        gbs, tflops = r["bytes"] / r["us"] / 1e3, r["flops"] / r["us"] / 1e6
        share = (gbs * 1e9 / bandwidth) if memory_bound else (tflops * 1e12 / peak)
        r.update(floor_us=floor, gb_s=gbs, tflop_s=tflops, peak_share=share)
        sdpa = f"{r['torch_sdpa_us']:.1f}" if "torch_sdpa_us" in r else "-"
        print(f"| {r['kernel']} | {r['model']} | {r['shape']} | {r['us']:.1f} | {floor:.1f} | {gbs:.0f} | "
              f"{tflops:.1f} | {share:.0%} | {sdpa} |")
    compiled = compiled_kernels()
    print("\ncompiled specializations (kernel, registers, spills, shared bytes, warps):")
    for c in compiled:
        print(f"  {c['kernel']}: regs {c['regs']}, spills {c['spills']}, shared {c['shared']}, warps {c['warps']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, rows=rows, compiled=compiled), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
