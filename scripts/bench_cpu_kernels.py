"""pagecli's CPU kernels on SmolLM2-135M's shapes, against what they replace.

    .venv/bin/python scripts/bench_cpu_kernels.py [--threads 2]
    .venv/bin/python scripts/bench_cpu_kernels.py --kv-attention [--kv-dtype int8 fp8] [--kv-layers 4]

Prints, best of several repeats (run it on an otherwise idle machine):
  weights   every projection of the 30 layers and the 49,152-row output layer, once, for 1..128
            rows: pagecli's AMX and bf16 rows kernels against F.linear (oneDNN), and a plain read
            of the same bytes (the memory floor); whether AMX gives oneDNN's bits
  attention one decode step's paged attention (30 layers) for 16 sequences of ~1,550 tokens, with
            and without a shared 1,500-token prefix in their block tables (one layer's cache, read
            30 times); 64 sequences of the batch workload's lengths over every layer's own cache;
            prefill attention of three steps, pagecli's kernel (AMX, or without AMX the AVX512-BF16
            decode kernel a row per prompt token) against PyTorch's SDPA
  step      one decode token through the whole model (no engine): DecodeStep (C++) against the
            Python layer loop with the same kernels

--kv-attention prints only issue 18's case, on the kernels of the level this process runs (any level,
AVX2 included): decode attention over 64 sequences of 2,000-4,000 tokens at SmolLM2-135M's attention
shape, a bf16 cache against int8 and fp8 ones (kv_format.py), ms per layer and the speed-up.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from pagecli.attention import AttentionMetadata
from pagecli.config import EngineConfig
from pagecli.engine import Engine


ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)


def best_ms(fn: Callable[[], object], inner: int = 5, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-attention", action="store_true", help="only decode attention over bf16, int8 and fp8 caches")
    ap.add_argument("--kv-dtype", nargs="+", default=["int8", "fp8"], choices=["int8", "fp8"])
    ap.add_argument("--kv-layers", type=int, default=4, help="layers, each its own cache (more than the L3 cache holds)")
    ap.add_argument("--kv-float", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                    help="the float cache (and query dtype) the quantized ones are compared with: bfloat16, or "
                         "float32, the dtype pagecli runs in on CPUs without AVX512-BF16 (AVX2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kv_attention:
        return quantized_kv_attention(args.kv_dtype, args.kv_layers, getattr(torch, args.kv_float))
    os.environ["PAGECLI_PACKED_GEMM"] = "0"  # the row-layout weights are what this script times and packs
    engine = Engine(None, EngineConfig(dtype="bfloat16", disk_cache=False))
    model, runner, backend = engine.loaded.model, engine.runner, engine.backend
    ops = backend.cpu_ops
    if ops is None or not ops.has_bf16_linear():
        raise SystemExit("needs pagecli's CPU kernels with AVX512-BF16")
    print(f"threads: {args.threads}")

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.output_weight]
    total = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.cat([w.flatten() for w in weights])  # the same bytes, contiguous
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 32)]).view(torch.int64)  # whole 64-byte lines
    flat = ops.weight_copy(flat)  # in the packed weights' kind of pages
    read = best_ms(lambda: ops.read_probe(flat))
    print(f"weights: {total / 1e6:.0f} MB; plain read (read_probe): {read:.2f} ms ({total / read / 1e6:.1f} GB/s)")
    for rows in ROWS:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
        onednn = best_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        line = f"  {rows:3d} rows: F.linear {onednn:6.2f} ms"
        if rows <= 16:
            line += f"   rows kernel {best_ms(lambda: [ops.linear_bf16_rows(xs[w.shape[1]], w, None) for w in weights]):6.2f} ms"
        if ops.has_amx():
            amx = best_ms(lambda: [ops.linear_bf16_amx(xs[w.shape[1]], w, None) for w in weights])
            same = all(torch.equal(ops.linear_bf16_amx(xs[w.shape[1]], w, None), F.linear(xs[w.shape[1]], w))
                       for w in weights)
            line += f"   AMX {amx:6.2f} ms ({'the same bits as' if same else 'not bit-identical to'} F.linear)"
        print(line, flush=True)

    bs, seqs, prefix = runner.block_size, 16, 1504
    shared = list(range(1, prefix // bs + 1))
    private = iter(range(len(shared) + 1, runner.kv_caches.shape[2]))
    lens = [prefix + 10 + 3 * i for i in range(seqs)]
    for label, tables in (
        ("shared prefix", [shared + [next(private) for _ in range(-(-n // bs) - len(shared))] for n in lens]),
        ("no sharing", [[next(private) for _ in range(-(-n // bs))] for n in lens]),
    ):
        meta = AttentionMetadata.build([1] * seqs, lens, tables, [0] * seqs, seqs)
        q = torch.randn(seqs, model.spec.num_heads, model.spec.head_dim).bfloat16()
        out = torch.empty_like(q)
        k_cache, v_cache = runner.kv_caches[0, 0], runner.kv_caches[0, 1]
        ms = best_ms(lambda: [ops.paged_decode_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                         0.125) for _ in range(model.spec.num_layers)])
        print(f"attention, {seqs} sequences of ~{lens[0]} tokens, {label}: {ms:.2f} ms per step")

    batch_attention(ops, model.spec, bs)

    length = 400
    table = list(range(1, length // bs + 2))
    meta = AttentionMetadata.build([1], [length], [table], [table[(length - 1) // bs] * bs + (length - 1) % bs], 1)
    ids, positions = torch.tensor([42]), torch.tensor([length - 1])

    def token() -> None:
        with torch.inference_mode():
            model.compute_logits(model(ids, positions, runner.kv_caches, meta, backend))

    in_cpp = best_ms(token, inner=20)
    step, model.decode_step = model.decode_step, None
    in_python = best_ms(token, inner=20)
    model.decode_step = step
    print(f"one token at {length} tokens of context, model + output layer: DecodeStep {in_cpp:.2f} ms, "
          f"Python layer loop {in_python:.2f} ms")


def scattered_case(spec, bs: int, seq_lens: list[int], query_lens: list[int], seed: int = 0):
    """Metadata for sequences whose blocks lie shuffled over a pool, and that pool for every layer
    (random bf16 K/V: the memory traffic of a real step, not one layer's cache read 30 times)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in seq_lens) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used, slots = [], 0, []
    for n, q in zip(seq_lens, query_lens):
        tables.append(order[used : used + -(-n // bs)])
        used += len(tables[-1])
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(n - q, n)]
    decodes = sum(1 for q in query_lens if q == 1)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, decodes)
    caches = torch.randn(spec.num_layers, 2, num_blocks, bs, spec.num_kv_heads, spec.head_dim, generator=gen)
    query = torch.randn(sum(query_lens), spec.num_heads, spec.head_dim, generator=gen).bfloat16()
    return meta, caches.bfloat16(), query


def quantized_kv_attention(kv_dtypes: list[str], num_layers: int, float_dtype: torch.dtype,
                           block_size: int = 16) -> None:
    """Decode attention over 64 sequences of 2,000-4,000 tokens in shuffled blocks (SmolLM2-135M's 9
    query heads, 3 kv heads, head_dim 64), each layer its own cache: float_dtype's, then each quantized
    format (the query in float_dtype throughout)."""
    from pagecli import native
    from pagecli.kv_format import quantize_rows

    ops = native.cpu_ops()
    if ops is None:
        raise SystemExit(f"needs pagecli's CPU kernels ({native.unavailable_reason()})")
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(2000, 4001, (64,), generator=gen).tolist()
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(order[used : used + -(-n // block_size)])
        used += len(tables[-1])
    meta = AttentionMetadata.build([1] * 64, lens, tables, [0] * 64, 64)
    query = torch.randn(64, heads, head_dim, generator=gen).to(float_dtype)
    out = torch.empty_like(query)
    values = [torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(float_dtype)
              for _ in range(num_layers)]  # [K/V, blocks, block_size, kv_heads, head_dim] per layer
    print(f"level {native.level()}, {torch.get_num_threads()} threads; decode attention, 64 sequences of "
          f"{min(lens)}-{max(lens)} tokens (block size {block_size}), {num_layers} layers each its own cache:")
    times = {}
    base = str(float_dtype).removeprefix("torch.")
    for name in [base, *kv_dtypes]:
        caches = values if name == base else [quantize_rows(layer, name) for layer in values]
        kv_bytes = sum(layer.numel() * layer.element_size() for layer in caches) * sum(lens) / (num_blocks * block_size)
        ms = best_ms(lambda: [ops.paged_decode_attention(out, query, layer[0], layer[1], meta.block_tables,
                                                         meta.seq_lens, 0.125) for layer in caches],
                     inner=1, repeats=5) / num_layers
        times[name] = ms
        speedup = "" if name == base else f", {times[base] / ms:.2f}x {base}'s speed"
        print(f"  {name:9s} cache: {ms:7.2f} ms per layer ({kv_bytes / num_layers / ms / 1e6:.1f} GB/s of K/V){speedup}",
              flush=True)
        del caches


def batch_attention(ops, spec, bs: int) -> None:
    """Attention as the batch and shared-prefix workloads give it, over all layers' caches."""
    from pagecli.attention.cpu_backend import CpuAttentionBackend

    gen = torch.Generator().manual_seed(0)
    lens = (torch.randint(39, 597, (64,), generator=gen) + 64).tolist()
    meta, caches, q = scattered_case(spec, bs, lens, [1] * 64)
    out = torch.empty_like(q)
    ms = best_ms(lambda: [ops.paged_decode_attention(out, q, layer[0], layer[1], meta.block_tables, meta.seq_lens,
                                                     0.125) for layer in caches], inner=2, repeats=5)
    kv_bytes = sum(lens) * spec.num_kv_heads * spec.head_dim * 2 * 2 * spec.num_layers
    print(f"decode attention, 64 sequences of {min(lens)}-{max(lens)} tokens in shuffled blocks, each layer its own "
          f"cache: {ms:.2f} ms per step ({kv_bytes / ms / 1e6:.1f} GB/s of K/V)")
    if ops.paged_prefill_supported(q, caches[0, 0]):
        kernel = "AMX kernel"
    elif ops.paged_decode_bf16_supported(q, caches[0, 0]):
        kernel = "AVX512-BF16 token rows"  # the decode kernel, a row per prompt token
    else:
        print("prefill attention: pagecli's kernels need AMX tiles or AVX512-BF16, which this CPU lacks")
        return
    native = CpuAttentionBackend(ops)
    sdpa = CpuAttentionBackend(ops)
    sdpa._native_prefill = lambda *args: False  # the per-sequence PyTorch path
    sdpa._prompts_as_decode_rows = lambda *args: False
    cases = {
        "a batch step: 7 prompts of 39-596 tokens, the first 16 tokens of each cached":
            ([300, 450, 120, 596, 39, 250, 310], [284, 434, 104, 580, 23, 234, 294]),
        "one 2,000-token prompt": ([2000], [2000]),
        "the batch workload's 64 prompts of 39-596 tokens, whole":
            (torch.randint(39, 597, (64,), generator=gen).tolist(),) * 2,
        "16 questions of 60 tokens after a 1,500-token cached prefix": ([1560] * 16, [60] * 16),
    }
    for label, (seq_lens, query_lens) in cases.items():
        meta, caches, q = scattered_case(spec, bs, seq_lens, query_lens)
        times = {}
        for name, backend in (("PyTorch SDPA", sdpa), (kernel, native)):
            times[name] = best_ms(lambda: [backend.forward(q, layer[0], layer[1], meta, 0.125) for layer in caches],
                                  inner=1, repeats=5)
        print(f"prefill attention, {label}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in times.items())
              + f" per step ({times['PyTorch SDPA'] / times[kernel]:.1f}x)")


if __name__ == "__main__":
    main()
