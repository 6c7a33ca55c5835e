"""pagecli's compiled kernels over a quantized KV cache (--kv-dtype int8/fp8, kv_format.py).

Stores must write the bytes kv_format.quantize_rows writes; decode attention over such a cache must
match the reference attention over the cache dequantized by kv_format.dequantize_rows, on the shapes
test_native_ops.py uses (shuffled block tables, GQA, block sizes 1 and 16, head sizes with and
without a specialised float version, a shared prefix); DecodeStep must equal the Python layer loop
over the same kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagecli import native
from pagecli.attention import AttentionMetadata
from pagecli.kv_format import dequantize_rows, quantize_rows
from pagecli.attention.reference import reference_paged_attention
from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.native import isa
from test_native_ops import PREFIX_LAYOUTS, assert_decode_step_matches_the_layer_loop, share_prefixes

if not native.enabled():
    pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off", allow_module_level=True)

COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}


@pytest.fixture(scope="module", params=COMPILED_LEVELS)
def ops(request):
    """The kernels of each instruction-set level this CPU runs."""
    return native.cpu_ops_for(request.param)


def empty_cache(fmt: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    # [num_blocks, block_size, kv_heads, head_dim + 2]; a fill byte the stores must overwrite
    return torch.full((num_blocks, block_size, kv_heads, head_dim + 2), 0x5A, dtype=torch.uint8).view(STORAGE[fmt])


def edge_rows(head_dim: int) -> torch.Tensor:
    """Rows that stress the format: zeros, signed zeros, one large value, huge and tiny magnitudes
    (scales that overflow or underflow float16, subnormal scales), values at the rounding ties."""
    rows = torch.zeros(10, head_dim)
    rows[1, ::2] = -0.0
    rows[2, 3] = 1e4
    rows[2, 4:] = torch.linspace(-1, 1, head_dim - 4)
    rows[3] = torch.linspace(-3e5, 3e5, head_dim)
    rows[4] = torch.linspace(-1e-9, 1e-9, head_dim)  # scale 0 in float16
    rows[5] = torch.linspace(-2e-5, 3e-5, head_dim)  # subnormal float16 scale
    rows[6] = torch.arange(head_dim) - head_dim / 2 + 0.5  # x.5 ties after scaling by 1 (max 127 when head_dim 254)
    rows[7, 0] = 127.0
    rows[7, 1:] = torch.arange(head_dim - 1) * 0.5 - 20  # ties at scale 1 (int8)
    rows[8, 0] = 448.0
    rows[8, 1:] = torch.linspace(-448, 448, head_dim - 1)
    rows[9] = torch.tensor([1e38 if d == 0 else -1.0 for d in range(head_dim)])  # scale inf in float16
    return rows


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_store_writes_the_bytes_quantize_rows_gives(ops, fmt, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    random_rows = torch.randn(40, 3, head_dim, generator=gen) * torch.rand(40, 3, 1, generator=gen) * 8
    edges = edge_rows(head_dim)
    if dtype != torch.float32:
        edges = edges[:-1]  # 1e38 is inf in fp16 and bf16 rounds it up: not finite input
    rows = torch.cat([random_rows, edges.view(-1, 1, head_dim).expand(-1, 3, -1)]).to(dtype)  # [tokens, 3, head_dim]
    num_tokens = rows.shape[0]
    block_size = 4
    cache = empty_cache(fmt, math.ceil(num_tokens / block_size) + 2, block_size, 3, head_dim)
    slots = torch.randperm(cache.shape[0] * block_size, generator=gen)[:num_tokens]
    slots[5] = -1  # a padding row: nothing stored
    before = cache.clone()
    ops.store_kv_quantized(rows, cache, slots)
    flat, flat_before = cache.view(-1, 3, head_dim + 2), before.view(-1, 3, head_dim + 2)
    kept = slots >= 0
    expected = quantize_rows(rows[kept], fmt)
    assert expected.dtype == cache.dtype
    got = flat[slots[kept]]
    mismatched = (got.view(torch.uint8) != expected.view(torch.uint8)).nonzero()
    assert mismatched.numel() == 0, f"bytes differ at (row, head, byte) {mismatched[:5].tolist()}"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.equal(flat[untouched], flat_before[untouched]), "slots not named (or -1) must be left alone"


def test_store_takes_strided_views_of_a_fused_projection(ops):
    # K and V as the engine has them: narrow views of one [tokens, q + k + v] projection output.
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, (4 + 2 + 2) * 32, generator=gen).bfloat16()
    k = qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
    cache = empty_cache("int8", 4, 2, 2, 32)
    slots = torch.tensor([7, 0, 3, 2, 6, 1])
    ops.store_kv_quantized(k, cache, slots)
    assert torch.equal(cache.view(-1, 2, 34)[slots], quantize_rows(k, "int8"))


def test_store_refuses_what_it_cannot_write(ops):
    rows = torch.randn(2, 2, 32)
    cache = empty_cache("int8", 2, 4, 2, 32)
    with pytest.raises(RuntimeError, match="int8 or uint8"):
        ops.store_kv_quantized(rows, torch.zeros(2, 4, 2, 34), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        ops.store_kv_quantized(rows, empty_cache("int8", 2, 4, 2, 16), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="int64"):
        ops.store_kv_quantized(rows, cache, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv_quantized(rows, cache, torch.tensor([0, 8]))


def quantized_decode_case(fmt, seq_lens, *, block_size, kv_heads, group, head_dim, dtype, seed=0):
    """As test_native_ops.paged_decode_case: random K/V (quantized) in shuffled blocks, a flat query
    batch whose first len(seq_lens) rows decode."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Rows of unequal magnitudes, so that the scales differ from row to row.
    k = torch.randn(*shape, generator=gen) * torch.rand(*shape[:3], 1, generator=gen) * 3
    v = torch.randn(*shape, generator=gen) * torch.rand(*shape[:3], 1, generator=gen) * 3
    k_cache, v_cache = quantize_rows(k.to(dtype), fmt), quantize_rows(v.to(dtype), fmt)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 1
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n] + [0] * (width - n))
        used += n
    query = torch.randn(len(seq_lens) + 2, kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)


def expected_attention(query, k_cache, v_cache, tables, lens, scale):
    """The reference over the cache dequantized to float32, in float32."""
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    k, v = dequantize_rows(k_cache, torch.float32), dequantize_rows(v_cache, torch.float32)
    return reference_paged_attention(query.float(), k, v, tables, starts, lens, scale)


# (atol, rtol) of the output in its dtype against float32 math on the dequantized cache: the kernel
# sums in another order (and scales scores and weights rather than values), in fp32.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.5e-2, 1e-2)}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 1, 64), (3, 3, 64), (1, 4, 80), (2, 2, 128), (2, 2, 48), (1, 16, 96)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_quantized_decode_matches_the_reference_on_the_dequantized_cache(ops, fmt, dtype, kv_heads, group, head_dim,
                                                                         block_size):
    seq_lens = [1, 7, 15, 16, 17, 300]
    query, k_cache, v_cache, tables, lens = quantized_decode_case(
        fmt, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype
    )
    n = len(seq_lens)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    ops.paged_decode_attention(out[:n], query[:n], k_cache, v_cache, tables, lens, scale)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:n].float(), expected_attention(query[:n], k_cache, v_cache, tables, lens, scale),
                               atol=atol, rtol=rtol)
    assert out[n:].isnan().all(), "rows past the decodes must be left alone"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_decode_with_zero_queries_zero_rows_and_far_apart_magnitudes(ops, fmt):
    # The AVX512-VNNI int8 path rounds each query row to int16 against its largest value and each
    # 16-token tile's softmax weights against the tile's largest: a query of zeros (scale 0), tiles
    # of zero rows (every weight times a zero scale), and a query whose values span 1e-3..1e3 must
    # still give the reference's answer.
    seq_lens = [40, 33, 64]
    query, k_cache, v_cache, tables, lens = quantized_decode_case(
        fmt, seq_lens, block_size=16, kv_heads=2, group=2, head_dim=64, dtype=torch.bfloat16, seed=5
    )
    query[0] = 0
    query[1, :, ::2] *= 1000
    query[1, :, 1::2] /= 1000
    zero_row = quantize_rows(torch.zeros(64), fmt)
    k_cache[tables[2, 1]] = zero_row
    v_cache[tables[2, 1]] = zero_row
    v_cache[tables[0, 0]] = zero_row
    out = torch.empty_like(query[:3])
    ops.paged_decode_attention(out, query[:3], k_cache, v_cache, tables, lens, 0.125)
    atol, rtol = TOLERANCES[torch.bfloat16]
    expected = expected_attention(query[:3], k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize(("block_size", "shared_blocks"), [(16, 5), (4, 9), (1, 40)])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 2, 128)])
@pytest.mark.parametrize("layout", PREFIX_LAYOUTS)
def test_quantized_decode_over_a_shared_prefix_is_bit_identical_to_one_sequence_at_a_time(
        ops, fmt, block_size, shared_blocks, threads, kv_heads, group, head_dim, layout):
    seq_lens = [shared_blocks * block_size + extra for extra in (0, 1, 7, 16, 40, 3)]
    query, k_cache, v_cache, tables, lens = quantized_decode_case(
        fmt, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim,
        dtype=torch.bfloat16, seed=block_size,
    )
    share_prefixes(tables, shared_blocks, layout)
    n = len(seq_lens)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = torch.empty_like(query[:n])
        ops.paged_decode_attention(together, query[:n], k_cache, v_cache, tables, lens, 0.125)
        alone = torch.empty_like(query[:n])
        for i in range(n):
            ops.paged_decode_attention(alone[i : i + 1], query[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                       lens[i : i + 1], 0.125)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone)
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(together.float(), expected_attention(query[:n], k_cache, v_cache, tables, lens, 0.125),
                               atol=atol, rtol=rtol)


@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_decode_splits_work_the_same_way_for_any_thread_count(ops, threads):
    seq_lens = [37 + 11 * i for i in range(9)]
    query, k_cache, v_cache, tables, lens = quantized_decode_case(
        "int8", seq_lens, block_size=16, kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=3
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty_like(query[:9])
        ops.paged_decode_attention(out, query[:9], k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, expected_attention(query[:9], k_cache, v_cache, tables, lens, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_quantized_decode_refuses_mismatched_caches(ops):
    query, k_cache, v_cache, tables, lens = quantized_decode_case(
        "int8", [5], block_size=4, kv_heads=1, group=2, head_dim=32, dtype=torch.float32
    )
    out = torch.empty_like(query[:1])
    with pytest.raises(RuntimeError, match="share a format"):
        ops.paged_decode_attention(out, query[:1], k_cache, v_cache.view(torch.uint8), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        ops.paged_decode_attention(out, query[:1], k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous(),
                                   tables, lens, 0.1)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_prefill_kernel_declines_quantized_caches(ops, fmt):
    # The Python side then dequantizes the context and runs PyTorch's attention.
    query = torch.randn(4, 4, 64).bfloat16()
    assert not ops.paged_prefill_supported(query, empty_cache(fmt, 2, 16, 2, 64))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # plain, q/k norm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_decode_step_in_cpp_over_a_quantized_cache_matches_the_python_layer_loop(tiny_model_factory, kv_dtype,
                                                                                      arch, dtype, rows):
    # The Python loop stores with store_kv_quantized and attends with paged_decode_attention, op by op.
    config = EngineConfig(dtype=dtype, disk_cache=False, block_size=4, kv_dtype=kv_dtype, num_blocks=64)
    with Engine(str(tiny_model_factory(arch)), config) as engine:
        model, backend, runner = engine.loaded.model, engine.backend, engine.runner
        assert model.decode_step is not None and runner.kv_caches.dtype == STORAGE[kv_dtype]
        gen = torch.Generator().manual_seed(rows)
        values = torch.randn(*runner.kv_caches.shape[:-1], runner.kv_caches.shape[-1] - 2, generator=gen)
        caches = quantize_rows(values, kv_dtype)
        assert_decode_step_matches_the_layer_loop(model, backend, caches, rows, gen)
