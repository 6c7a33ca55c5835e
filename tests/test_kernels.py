"""The Triton kernels (pagecli.kernels) against the fp32 reference: on a GPU when there is one,
else on CPU in Triton's interpreter, which runs one program at a time (about 0.4 ms each),
so the interpreter cases keep shapes small and cover each size of interest once.
"""

import os

import torch

if not torch.cuda.is_available():
    # @triton.jit reads the switch when the kernels are decorated, i.e. on first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from pagecli.attention.metadata import AttentionMetadata  # noqa: E402
from pagecli.attention.reference import reference_paged_attention, reference_store_kv  # noqa: E402
from pagecli.attention.reference_backend import ReferenceAttentionBackend  # noqa: E402
from pagecli.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagecli.kernels import paged_decode_attention, paged_prefill_attention, store_kv  # noqa: E402
from pagecli.kernels.common import interpreting  # noqa: E402
from pagecli.kernels.decode import choose_num_splits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not interpreting():
    raise RuntimeError(
        "pagecli.kernels was imported before TRITON_INTERPRET=1 was set; set it in the environment "
        "(or in tests/conftest.py) so the kernels run in Triton's interpreter on this machine."
    )

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

# (atol, rtol) against the fp32 reference computed from the same stored values.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1e-2),
}


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_lens: tuple[int, ...]
    scale: float


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V already in a cache laid out like the engine's (views of one per-model buffer),
    each sequence on distinct blocks in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 2
    # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; layer 1 so the views start mid-buffer.
    buffer = torch.randn(2, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    buffer = buffer.to(DEVICE, dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_needed, default=1) or 1
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(order[used : used + n] + [0] * (max_blocks - n))
        used += n
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    return PagedBatch(
        query=query,
        k_cache=buffer[1, 0],
        v_cache=buffer[1, 1],
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_lens=tuple(query_lens),
        scale=head_dim**-0.5,
    )


def reference(batch: PagedBatch) -> torch.Tensor:
    """The fp32 reference on CPU, as float32: [num_tokens, num_heads, head_dim]."""
    return reference_paged_attention(
        batch.query.cpu().float(),
        batch.k_cache.cpu(),
        batch.v_cache.cpu(),
        batch.block_tables.cpu(),
        batch.query_start_loc.cpu(),
        batch.seq_lens.cpu(),
        batch.scale,
    )


def decode(batch: PagedBatch, **kwargs) -> torch.Tensor:
    return paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale, **kwargs
    )


def prefill(batch: PagedBatch) -> torch.Tensor:
    return paged_prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        batch.scale,
        max(batch.query_lens),
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), atol=atol, rtol=rtol)


# Context lengths around a block edge, a single token, and a few hundred (several tiles).
DECODE_SEQ_LENS = [1, 15, 16, 17, 300]


# --- KV store --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "head_dim", "key_dtype", "cache_dtype"),
    [
        (1, 64, torch.float32, torch.float32),
        (16, 80, torch.bfloat16, torch.bfloat16),
        (32, 128, torch.float16, torch.float16),
        (16, 64, torch.float32, torch.bfloat16),
    ],
)
def test_store_kv_writes_each_token_to_its_slot_bit_exact(block_size, head_dim, key_dtype, cache_dtype):
    kv_heads, num_tokens = 2, 7
    num_blocks = math.ceil(2 * num_tokens / block_size)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
    k_cache, v_cache = cache[1, 0], cache[1, 1]
    # K and V as the model produces them: column slices of one fused qkv projection.
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, generator=gen).to(DEVICE, key_dtype)
    key = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1  # padding tokens are skipped
    slots[5] = -1
    slot_mapping = slots.to(DEVICE)

    expected = cache.clone()
    reference_store_kv(key.to(cache_dtype), value.to(cache_dtype), expected[1, 0], expected[1, 1], slot_mapping)
    store_kv(key, value, k_cache, v_cache, slot_mapping)

    assert torch.equal(cache, expected)  # the whole buffer: slot -1 must not write before the cache


def test_store_kv_leaves_the_other_layer_untouched():
    kv_heads, head_dim, block_size = 1, 64, 16
    cache = torch.zeros(2, 2, 2, block_size, kv_heads, head_dim, device=DEVICE)
    key = torch.ones(3, kv_heads, head_dim, device=DEVICE)
    store_kv(key, 2 * key, cache[1, 0], cache[1, 1], torch.tensor([0, 17, 31], device=DEVICE))
    assert not cache[0].any()
    assert cache[1, 0].sum().item() == 3 * head_dim
    assert cache[1, 1].sum().item() == 2 * 3 * head_dim


# --- Decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "head_dim"),
    [
        (16, 2, 1, 64),
        (1, 1, 3, 80),
        (32, 1, 8, 128),
        (16, 2, 4, 80),
    ],
)
def test_decode_matches_reference_fp32(block_size, kv_heads, group, head_dim):
    query_lens = [1] * len(DECODE_SEQ_LENS)
    batch = make_batch(
        query_lens, DECODE_SEQ_LENS, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim
    )
    assert_close(decode(batch, num_splits=1), reference(batch), torch.float32)


@pytest.mark.parametrize(("num_splits", "min_split_tokens"), [(4, 16), (3, 64)])
def test_decode_split_kv_equals_single_pass(num_splits, min_split_tokens):
    # Length 1 leaves later splits empty; 300 uses all of them.
    batch = make_batch(
        [1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, block_size=16, kv_heads=1, group=2, head_dim=64, seed=3
    )
    single = decode(batch, num_splits=1)
    split = decode(batch, num_splits=num_splits, min_split_tokens=min_split_tokens)
    torch.testing.assert_close(split, single, atol=2e-6, rtol=1e-5)
    assert_close(split, reference(batch), torch.float32)


def test_decode_zero_length_rows_give_zeros_with_and_without_splits():
    # A batch padded for a captured graph carries rows with seq_len 0; they must not produce NaN.
    batch = make_batch([1, 1], [0, 20], block_size=16, kv_heads=1, group=2, head_dim=64)
    for num_splits in (1, 2):
        out = decode(batch, num_splits=num_splits, min_split_tokens=16)
        assert not out[0].any()
        assert_close(out[1:], reference(batch)[1:], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision_cache_matches_reference(dtype):
    batch = make_batch([1, 1, 1], [17, 33, 140], block_size=16, kv_heads=2, group=2, head_dim=64, dtype=dtype)
    out = decode(batch, num_splits=2, min_split_tokens=32)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype)


def test_choose_num_splits_is_one_off_gpu_and_fills_a_gpu_otherwise():
    assert choose_num_splits(1, 8, torch.device("cpu")) == 1
    if torch.cuda.is_available():
        assert choose_num_splits(1, 1, DEVICE) > 1
        assert choose_num_splits(4096, 8, DEVICE) == 1


# --- Prefill over a paged prefix ---------------------------------------------------------------

# (new tokens, prefix length): no prefix; a prefix of two blocks and a bit; a single new token
# behind three blocks; a chunk that starts on a block edge.
PREFILL_SEQS = [(20, 0), (5, 33), (1, 48), (17, 16)]


@pytest.mark.parametrize(
    ("block_size", "kv_heads", "group", "head_dim"),
    [
        (16, 2, 1, 64),
        (1, 1, 3, 80),
        (32, 1, 8, 128),
        (16, 1, 4, 80),
    ],
)
def test_prefill_matches_reference_fp32(block_size, kv_heads, group, head_dim):
    query_lens = [q for q, _ in PREFILL_SEQS]
    seq_lens = [q + prefix for q, prefix in PREFILL_SEQS]
    batch = make_batch(
        query_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim, seed=5
    )
    assert_close(prefill(batch), reference(batch), torch.float32)


def test_prefill_without_prefix_spanning_several_query_blocks():
    # 70 tokens at group 2 is three query blocks of 32 tokens; causal inside each block.
    batch = make_batch([70], [70], block_size=16, kv_heads=1, group=2, head_dim=64, seed=6)
    assert_close(prefill(batch), reference(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision_cache_matches_reference(dtype):
    batch = make_batch([9, 4], [9, 40], block_size=16, kv_heads=1, group=2, head_dim=64, dtype=dtype, seed=7)
    out = prefill(batch)
    assert out.dtype == dtype
    assert_close(out, reference(batch), dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_with_the_hopper_tile_matches_reference(head_dim):
    """sm_90 launches 16-bit prefill with 64 rows x up to 128 K/V tokens per step (timed faster on an H100);
    on CPU, `targeting(90)` makes the launcher choose that tile, so the interpreter checks its arithmetic."""
    from pagecli.kernels.common import targeting
    from pagecli.kernels.prefill import prefill_tiles

    hopper = prefill_tiles(head_dim, torch.bfloat16, "float", 2, arch=90)
    ampere = prefill_tiles(head_dim, torch.bfloat16, "float", 2, arch=80)
    assert hopper.block_n == 16384 // (head_dim * 2) and hopper != ampere
    batch = make_batch([150, 3], [350, 140], block_size=16, kv_heads=1, group=2, head_dim=head_dim,
                       dtype=torch.bfloat16, seed=8)  # several K/V tiles of 128 (or 64) tokens, a partial last one
    with targeting(90):
        out = prefill(batch)
    assert_close(out, reference(batch), torch.bfloat16)


# --- Backend ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "num_decode_seqs"),
    [
        ([1, 1, 1, 6, 12], 3),  # mixed: decodes first, then prefill chunks
        ([1, 1], 2),  # decode only
        ([7, 1], 0),  # prefill only, one of them a single-token chunk
    ],
)
def test_triton_backend_step_equals_torch_backend(query_lens, num_decode_seqs):
    block_size, kv_heads, group, head_dim = 16, 2, 2, 64
    prefix_lens = [16, 40, 1, 0, 20, 33][: len(query_lens)]
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    batch = make_batch(query_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim)
    tables = [row[: math.ceil(n / block_size)] for row, n in zip(batch.block_tables.tolist(), seq_lens)]
    slots = [
        tables[i][pos // block_size] * block_size + pos % block_size
        for i, (p, n) in enumerate(zip(prefix_lens, seq_lens))
        for pos in range(p, n)
    ]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, num_decode_seqs, device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE)

    results = []
    for backend in (TritonAttentionBackend(), ReferenceAttentionBackend()):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        backend.store_kv(key, value, k_cache, v_cache, meta)
        results.append((k_cache, v_cache, backend.forward(batch.query, k_cache, v_cache, meta, batch.scale)))
    (triton_k, triton_v, triton_out), (torch_k, torch_v, torch_out) = results

    assert torch.equal(triton_k, torch_k) and torch.equal(triton_v, torch_v)
    assert_close(triton_out, torch_out, torch.float32)


@pytest.mark.parametrize(("softcap", "window"), [(3.0, None), (None, 5), (2.0, 21)])
def test_triton_backend_soft_capped_and_sliding_layers_equal_the_torch_backend(softcap, window):
    """Gemma's layers: decodes and prefill chunks after cached prefixes longer than the window (and one
    shorter), the window smaller and larger than a K/V tile, chunks spanning several query blocks."""
    block_size, kv_heads, group, head_dim = 4, 2, 2, 16
    query_lens, num_decode_seqs = [1, 1, 9, 40], 2
    prefix_lens = [30, 3, 17, 6]
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    batch = make_batch(query_lens, seq_lens, block_size=block_size, kv_heads=kv_heads, group=group, head_dim=head_dim)
    tables = [row[: math.ceil(n / block_size)] for row, n in zip(batch.block_tables.tolist(), seq_lens)]
    slots = [tables[i][pos // block_size] * block_size + pos % block_size
             for i, (p, n) in enumerate(zip(prefix_lens, seq_lens)) for pos in range(p, n)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, num_decode_seqs, device=DEVICE)
    query = batch.query * 3  # scores large enough that the cap bends them
    triton_out = TritonAttentionBackend().forward(query, batch.k_cache, batch.v_cache, meta, batch.scale,
                                                  softcap=softcap, window=window)
    torch_out = ReferenceAttentionBackend().forward(query.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(), meta,
                                                    batch.scale, softcap=softcap, window=window)
    assert_close(triton_out, torch_out, torch.float32)
    plain = ReferenceAttentionBackend().forward(query.cpu(), batch.k_cache.cpu(), batch.v_cache.cpu(), meta,
                                                batch.scale)
    assert not torch.allclose(plain, torch_out, atol=1e-3)  # the cap or the window changed the result


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_a_window_reads_no_position_before_it(num_splits):
    """Positions before each sequence's window hold NaN: split or not, the decode kernel never loads them."""
    block_size, window = 4, 6
    seq_lens = [27, 5, 40]
    batch = make_batch([1, 1, 1], seq_lens, block_size=block_size, kv_heads=2, group=2, head_dim=16)
    tables = batch.block_tables.tolist()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    for table, seq_len in zip(tables, seq_lens):
        for pos in range(max(0, seq_len - window)):
            k_cache[table[pos // block_size], pos % block_size] = float("nan")
            v_cache[table[pos // block_size], pos % block_size] = float("nan")
    out = paged_decode_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                                 num_splits=num_splits, min_split_tokens=4, window=window, softcap=2.5)
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, [t[: math.ceil(n / block_size)] for t, n in
                                                          zip(tables, seq_lens)], [0, 0, 0], 3, device="cpu")
    expected = ReferenceAttentionBackend().forward(batch.query.cpu(), k_cache.cpu(), v_cache.cpu(), meta,
                                                   batch.scale, softcap=2.5, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, expected, torch.float32)


# --- GPU only: sizes the interpreter would take minutes over -------------------------------------


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_long_contexts_gpu(dtype):
    seq_lens = [1, 17, 255, 256, 257, 1025, 4000, 8191]
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, block_size=16, kv_heads=8, group=4, head_dim=128, dtype=dtype, seed=21
    )
    expected = reference(batch)
    assert_close(decode(batch), expected, dtype)  # automatic split count
    assert_close(decode(batch, num_splits=1), expected, dtype)
    assert_close(decode(batch, num_splits=16), expected, dtype)


@gpu
@requires_cuda
@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (5, 80), (8, 64)])
def test_prefill_long_prompts_gpu(group, head_dim):
    seqs = [(1000, 0), (300, 700), (1, 2000), (129, 64)]
    query_lens, seq_lens = [q for q, _ in seqs], [q + p for q, p in seqs]
    batch = make_batch(
        query_lens, seq_lens, block_size=16, kv_heads=2, group=group, head_dim=head_dim, dtype=torch.bfloat16, seed=22
    )
    assert_close(prefill(batch), reference(batch), torch.bfloat16)


@gpu
@requires_cuda
def test_kernels_address_caches_past_two_to_the_31_elements_gpu():
    block_size, kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 8  # ~4.3 GB per cache in bf16
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    last_block = num_blocks - 1
    key = torch.randn(block_size, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.arange(block_size, device=DEVICE, dtype=torch.int64) + last_block * block_size
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[last_block], key) and torch.equal(v_cache[last_block], value)

    query = torch.randn(1, kv_heads * 2, head_dim, device=DEVICE, dtype=torch.bfloat16)
    table = torch.tensor([[last_block]], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([block_size], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(query, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float().view(kv_heads, 2, head_dim), key.float().transpose(0, 1), value.float().transpose(0, 1),
        scale=head_dim**-0.5,
    ).reshape(1, kv_heads * 2, head_dim)
    assert_close(out, expected, torch.bfloat16)
