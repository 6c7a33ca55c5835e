"""The Triton kernels on a quantized KV cache (--kv-dtype int8|fp8, pagecli/kv_format.py): the store
writes the bytes of kv_format.quantize_rows, and decode and prefill over int8/fp8 rows match the fp32 reference
run on the same caches dequantized by kv_format.dequantize_rows. On a GPU when there is one, else in Triton's
interpreter (small shapes: it runs one program at a time).
"""

import os

import torch

if not torch.cuda.is_available():
    # @triton.jit reads the switch when the kernels are decorated, i.e. on first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagecli.attention.block_copy import copy_blocks  # noqa: E402
from pagecli.kv_format import KVFormat, dequantize_rows, quantize_rows  # noqa: E402
from pagecli.attention.metadata import AttentionMetadata  # noqa: E402
from pagecli.attention.reference_backend import ReferenceAttentionBackend  # noqa: E402
from pagecli.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagecli.kernels import store_kv  # noqa: E402
from pagecli.kernels.common import e4m3fn_bits, round_half_even, widen_quantized  # noqa: E402
from test_kernels import (  # noqa: E402
    DECODE_SEQ_LENS,
    DEVICE,
    PREFILL_SEQS,
    PagedBatch,
    assert_close,
    decode,
    make_batch,
    prefill,
    reference,
)

FORMATS = ("int8", "fp8")
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def quantized_batch(batch: PagedBatch, name: str, seed: int = 0) -> tuple[PagedBatch, PagedBatch]:
    """The batch's K/V, each row scaled by its own factor (so rows get distinct scales: K's 0.05..1.6, keeping
    the scores within what fp32 softmax reproduces to 1e-5; V's 0.01..10), quantized
    into views of one engine-like buffer [num_layers, 2, num_blocks, block_size, kv_heads, head_dim + 2];
    and the same batch over those caches dequantized to fp32, for the reference."""
    gen = torch.Generator().manual_seed(seed)
    k, v = batch.k_cache.cpu().float(), batch.v_cache.cpu().float()
    picks = torch.randint(0, 64, (2, *k.shape[:3], 1), generator=gen)
    k_factors, v_factors = torch.logspace(-1.3, 0.2, 64)[picks[0]], torch.logspace(-2, 1, 64)[picks[1]]
    fmt = KVFormat(name, k.shape[3])
    buffer = torch.zeros(2, 2, *fmt.cache_shape(*k.shape[:3]), dtype=fmt.storage_dtype)
    buffer[1, 0] = quantize_rows(k * k_factors, name)
    buffer[1, 1] = quantize_rows(v * v_factors, name)
    buffer = buffer.to(DEVICE)
    quantized = dataclasses.replace(batch, k_cache=buffer[1, 0], v_cache=buffer[1, 1])
    dequantized = dataclasses.replace(batch, k_cache=dequantize_rows(buffer[1, 0], torch.float32),
                                      v_cache=dequantize_rows(buffer[1, 1], torch.float32))
    return quantized, dequantized


def kv_rows(num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[num_tokens, kv_heads, head_dim] rows from 1e-6 to 1e3 in magnitude, one of them all zeros and one
    whose max is so small its scale rounds to 0 in float16."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-6, 3, num_tokens * kv_heads)[torch.randperm(num_tokens * kv_heads, generator=gen)]
    rows = torch.randn(num_tokens, kv_heads, head_dim, generator=gen) * magnitudes.view(num_tokens, kv_heads, 1)
    rows[0, 0] = 0.0
    rows[1, 0] = 0.0
    rows[1, 0, 3] = -1e-7
    return rows.to(DEVICE, dtype)


# --- KV store --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "key_dtype"),
    [(1, 64, torch.float32), (16, 80, torch.bfloat16), (32, 128, torch.float16)],
)
def test_store_kv_quantizes_each_row_to_the_bytes_of_quantize_rows(name, block_size, head_dim, key_dtype):
    kv_heads, num_tokens = 2, 7
    fmt = KVFormat(name, head_dim)
    num_blocks = math.ceil(2 * num_tokens / block_size)
    gen = torch.Generator().manual_seed(2)
    # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim + 2], random bytes: untouched slots keep theirs.
    cache = torch.randint(-128, 128, (2, 2, *fmt.cache_shape(num_blocks, block_size, kv_heads)), generator=gen,
                          dtype=torch.int8).view(fmt.storage_dtype).to(DEVICE)
    # K and V as the model produces them: column slices of one fused qkv projection.
    qkv = torch.zeros(num_tokens, 3 * kv_heads * head_dim, dtype=key_dtype, device=DEVICE)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    key.copy_(kv_rows(num_tokens, kv_heads, head_dim, key_dtype, seed=3))
    value.copy_(kv_rows(num_tokens, kv_heads, head_dim, key_dtype, seed=4))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1  # padding tokens are skipped
    slots[5] = -1
    slot_mapping = slots.to(DEVICE)

    expected = cache.clone()
    keep = slots >= 0
    flat = expected[1].view(2, -1, kv_heads, fmt.row_width)  # [2, num_slots, kv_heads, row]
    flat[0, slots[keep]] = quantize_rows(key[keep.to(DEVICE)], name).to(flat.device)
    flat[1, slots[keep]] = quantize_rows(value[keep.to(DEVICE)], name).to(flat.device)
    store_kv(key, value, cache[1, 0], cache[1, 1], slot_mapping)

    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))  # the whole buffer, scales included


@pytest.mark.parametrize("name", FORMATS)
def test_store_kv_rounds_ties_to_even(name):
    # A row whose max is the format's limit has scale 1.0, so the data is the value itself rounded:
    # int8 at every half-integer, fp8 at the midpoints between e4m3 neighbours, subnormal ones included.
    limit = 127.0 if name == "int8" else 448.0
    if name == "int8":
        ties = torch.arange(-126.5, 127.0, 1.0)
    else:
        values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
        ties = torch.cat([(values[:-1] + values[1:]) / 2, -(values[:-1] + values[1:]) / 2])
    head_dim = 64
    rows = ties[: (len(ties) // (head_dim - 1)) * (head_dim - 1)].view(-1, head_dim - 1)
    rows = torch.cat([rows, torch.full((rows.shape[0], 1), limit)], dim=1).view(-1, 1, head_dim).to(DEVICE)
    fmt = KVFormat(name, head_dim)
    cache = torch.zeros(2, *fmt.cache_shape(rows.shape[0], 1, 1), dtype=fmt.storage_dtype, device=DEVICE)
    store_kv(rows, rows, cache[0], cache[1], torch.arange(rows.shape[0], device=DEVICE))
    expected = quantize_rows(rows, name).view(-1, 1, 1, fmt.row_width)
    assert torch.equal(cache[0].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(cache[1].view(torch.uint8), expected.view(torch.uint8))


@triton.jit
def _format_helpers_kernel(x_ptr, rounded_ptr, e4m3_ptr, byte_ptr, widened_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(x_ptr + offsets)
    tl.store(rounded_ptr + offsets, round_half_even(x * 64.0))
    tl.store(e4m3_ptr + offsets, e4m3fn_bits(tl.minimum(tl.maximum(x, -448.0), 448.0)))
    byte = tl.load(byte_ptr + (offsets % 256))
    tl.store(widened_ptr + offsets, widen_quantized(byte, "fp8").to(tl.float32))


def test_fp8_bits_and_rounding_helpers_match_torch_on_every_byte_and_their_midpoints():
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 >= 0
    midpoints = (values[:-1] + values[1:]) / 2
    near = torch.cat([values, midpoints, torch.nextafter(midpoints, torch.zeros(1)),
                      torch.nextafter(midpoints, torch.full((1,), 500.0))])
    gen = torch.Generator().manual_seed(8)
    x = torch.cat([near, -near, torch.randn(2048, generator=gen) * torch.logspace(-4, 2, 2048)])
    n = triton.next_power_of_2(len(x))
    x = torch.cat([x, torch.zeros(n - len(x))]).to(DEVICE)
    rounded = torch.empty(n, device=DEVICE)
    e4m3 = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    widened = torch.empty(n, device=DEVICE)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    _format_helpers_kernel[(1,)](x, rounded, e4m3, every_byte, widened, N=n)

    assert torch.equal(rounded, torch.round(x * 64.0))  # half to even
    assert torch.equal(e4m3, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    finite = (every_byte & 0x7F) != 0x7F  # 0x7F and 0xFF are NaN
    expected = every_byte.view(torch.float8_e4m3fn).float() / 256
    assert torch.equal(widened[:256][finite], expected[finite])


# --- Decode and prefill over quantized caches ---------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "head_dim"),
    [(16, 2, 1, 64), (1, 1, 3, 80), (32, 1, 8, 128), (16, 2, 4, 80)],
)
def test_decode_over_quantized_cache_matches_reference_on_its_dequantized_values(
    name, block_size, kv_heads, group, head_dim
):
    batch = make_batch([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, block_size=block_size, kv_heads=kv_heads,
                       group=group, head_dim=head_dim)
    quantized, dequantized = quantized_batch(batch, name)
    assert_close(decode(quantized, num_splits=1), reference(dequantized), torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_decode_over_quantized_cache_split_kv_and_zero_length_rows(name):
    batch = make_batch([1] * 6, [0, *DECODE_SEQ_LENS], block_size=16, kv_heads=1, group=2, head_dim=64, seed=3)
    quantized, dequantized = quantized_batch(batch, name, seed=3)
    out = decode(quantized, num_splits=4, min_split_tokens=16)
    assert not out[0].any()  # a padded row of length 0 gives zeros, not NaN
    assert_close(out[1:], reference(dequantized)[1:], torch.float32)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "head_dim"),
    [(16, 2, 1, 64), (1, 1, 3, 80), (32, 1, 8, 128), (16, 1, 4, 80)],
)
def test_prefill_over_quantized_cache_matches_reference_on_its_dequantized_values(
    name, block_size, kv_heads, group, head_dim
):
    query_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens = [q + prefix for q, prefix in PREFILL_SEQS]
    batch = make_batch(query_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group,
                       head_dim=head_dim, seed=5)
    quantized, dequantized = quantized_batch(batch, name, seed=5)
    assert_close(prefill(quantized), reference(dequantized), torch.float32)


@pytest.mark.parametrize(("name", "dtype"), [("int8", torch.bfloat16), ("fp8", torch.float16)])
def test_half_precision_queries_over_quantized_cache(name, dtype):
    batch = make_batch([1, 1, 9], [17, 140, 40], block_size=16, kv_heads=2, group=2, head_dim=64, dtype=dtype,
                       seed=7)
    quantized, dequantized = quantized_batch(batch, name, seed=7)
    expected = reference(dequantized)
    decoded = decode(dataclasses.replace(quantized, query=batch.query[:2], seq_lens=batch.seq_lens[:2],
                                         block_tables=batch.block_tables[:2]), num_splits=2, min_split_tokens=32)
    assert decoded.dtype == dtype
    assert_close(decoded, expected[:2], dtype)
    prefill_only = dataclasses.replace(
        quantized, seq_lens=batch.seq_lens[2:], block_tables=batch.block_tables[2:],
        query_start_loc=batch.query_start_loc[2:], query_lens=batch.query_lens[2:])
    prefilled = prefill(prefill_only)
    assert_close(prefilled[2:], expected[2:], dtype)


# --- Backend and block copy ------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_triton_backend_step_on_quantized_cache_equals_torch_backend(name):
    # Decodes then prefill chunks: the store writes the new rows quantized, then both kernels read them.
    block_size, kv_heads, group, head_dim = 16, 2, 2, 64
    query_lens, prefix_lens, num_decode_seqs = [1, 1, 6, 12], [16, 40, 0, 20], 2
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    batch = make_batch(query_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group,
                       head_dim=head_dim)
    quantized, _ = quantized_batch(batch, name)
    tables = [row[: math.ceil(n / block_size)] for row, n in zip(batch.block_tables.tolist(), seq_lens)]
    slots = [tables[i][pos // block_size] * block_size + pos % block_size
             for i, (p, n) in enumerate(zip(prefix_lens, seq_lens)) for pos in range(p, n)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, num_decode_seqs, device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE)

    results = []
    for backend in (TritonAttentionBackend(), ReferenceAttentionBackend()):
        k_cache, v_cache = quantized.k_cache.clone(), quantized.v_cache.clone()
        backend.store_kv(key, value, k_cache, v_cache, meta)
        results.append((k_cache, v_cache, backend.forward(batch.query, k_cache, v_cache, meta, batch.scale)))
    (triton_k, triton_v, triton_out), (torch_k, torch_v, torch_out) = results

    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)
    assert_close(triton_out, torch_out, torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_copy_blocks_moves_quantized_rows_with_their_scales(name):
    fmt = KVFormat(name, 64)
    gen = torch.Generator().manual_seed(12)
    values = torch.randn(2, 2, 4, 8, 2, 64, generator=gen) * torch.logspace(-2, 1, 8).view(1, 1, 1, 8, 1, 1)
    kv_caches = quantize_rows(values, name).to(DEVICE)  # [num_layers, 2, num_blocks, block_size, kv_heads, row]
    assert kv_caches.shape[-1] == fmt.row_width
    before = kv_caches.clone()
    copy_blocks(kv_caches, [1, 3], [2, 1])  # block 1 is a source and a destination: it gives its old rows
    assert torch.equal(kv_caches[:, :, 2], before[:, :, 1]) and torch.equal(kv_caches[:, :, 1], before[:, :, 3])
    assert torch.equal(kv_caches[:, :, [0, 3]], before[:, :, [0, 3]])
    copied, source = dequantize_rows(kv_caches[:, :, 2], torch.float32), dequantize_rows(before[:, :, 1], torch.float32)
    assert torch.equal(copied, source)


# --- GPU only: sizes the interpreter would take minutes over -------------------------------------


@gpu
@requires_cuda
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_cache_long_contexts_gpu(name, dtype):
    seq_lens = [1, 17, 257, 1025, 4000]
    batch = make_batch([1] * len(seq_lens), seq_lens, block_size=16, kv_heads=8, group=4, head_dim=128,
                       dtype=dtype, seed=21)
    quantized, dequantized = quantized_batch(batch, name, seed=21)
    expected = reference(dequantized)
    assert_close(decode(quantized), expected, dtype)
    assert_close(decode(quantized, num_splits=16), expected, dtype)
    seqs = [(1000, 0), (300, 700), (129, 64)]
    batch = make_batch([q for q, _ in seqs], [q + p for q, p in seqs], block_size=16, kv_heads=2, group=4,
                       head_dim=128, dtype=dtype, seed=22)
    quantized, dequantized = quantized_batch(batch, name, seed=22)
    assert_close(prefill(quantized), reference(dequantized), dtype)
