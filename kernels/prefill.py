"""Prefill attention over a paged prefix: new query tokens of many sequences in one launch.

Each sequence brings query_len new tokens whose K/V are already stored in the cache
behind a cached prefix of seq_len - query_len positions. Query token j sits at position
prefix_len + j and sees every position <= its own, so one paged loop with the rule
key_pos <= query_pos covers both the prefix (full) and the new tokens (causal).
A program takes BLOCK_Q query tokens times all GROUP query heads of one KV head as the
rows of its tile, so the K/V tiles it loads serve every head that shares them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagecli.kernels.common import (
    LOG2_E,
    cache_head_dim,
    device_arch,
    dot_dtype,
    fp32_dot,
    interpreting,
    kv_format_of,
    kv_tile_tokens,
    load_kv_tile,
    load_quantized_kv_tile,
    online_softmax_step,
    online_softmax_step_rows_may_be_empty,
    soft_cap,
    tile_element_bytes,
)


@triton.jit
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], or head_dim + 2 bytes when quantized
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32, rows of query_ptr
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    stride_query_token,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    head_dim,
    window,  # with SLIDING: a query at position p sees positions p - window + 1 .. p only
    softcap_log2,  # with SOFTCAP: the cap times log2(e); scores become cap * tanh(score / cap)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "float" (the cache's dtype), "int8" or "fp8" (common.load_quantized_kv_tile)
    SLIDING: tl.constexpr = False,  # a sliding-window layer (Gemma): tiles before every row's window are not read
    SOFTCAP: tl.constexpr = False,  # soft-capped scores (Gemma 2)
):
    seq = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_block * BLOCK_Q >= query_len:
        return  # the grid is sized for the longest query in the batch
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = q_block * BLOCK_Q + rows // GROUP  # within this sequence's new tokens
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
    query_pos = prefix_len + query_index
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]

    tokens = (query_start + query_index).to(tl.int64)
    q_offsets = tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=io_mask, other=0.0)  # [BLOCK_M, D_PAD]
    if FP32_DOT:
        q = q.to(tl.float32)
    elif KV_FORMAT == "float":
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The last query token of this block sees positions up to its own; nothing past it.
    kv_end = tl.minimum(seq_len, prefix_len + (q_block + 1) * BLOCK_Q)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_cache_head
    first = 0  # the first position any row of this block sees
    if SLIDING:
        first = tl.maximum(prefix_len + q_block * BLOCK_Q - window + 1, 0)
    for tile_start in range(first, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = positions < kv_end
        if KV_FORMAT == "float":
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, positions, pos_mask, dims, dim_mask,
                stride_cache_block, stride_cache_slot, head_offset, BLOCK_SIZE, FP32_DOT,
            )  # [BLOCK_N, D_PAD] each
            scores = fp32_dot(q, tl.trans(k), FP32_DOT) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        else:
            k, k_scale, v = load_quantized_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, positions, pos_mask, dims, dim_mask,
                stride_cache_block, stride_cache_slot, head_offset, head_dim, q.dtype, BLOCK_SIZE, KV_FORMAT,
            )  # [BLOCK_N, D_PAD], [BLOCK_N], [BLOCK_N, D_PAD]
            scores = fp32_dot(q, tl.trans(k), FP32_DOT) * (k_scale * qk_scale)[None, :]  # log2 domain
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        visible = (positions[None, :] <= query_pos[:, None]) & pos_mask[None, :]
        if SLIDING:
            # A row's window may begin past this tile: it then has no finite score here.
            visible = visible & (positions[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_i, l_i, acc = online_softmax_step_rows_may_be_empty(m_i, l_i, acc, scores, v, FP32_DOT)
        else:
            scores = tl.where(visible, scores, float("-inf"))
            # Position 0 is visible to every row, so each row has a finite score in the first tile.
            m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, FP32_DOT)

    if SLIDING:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # padding rows past the query saw nothing (they are not stored)
    out = acc / l_i[:, None]
    out_offsets = tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


class PrefillTiles(NamedTuple):
    """A launch's tile: query rows per program (BLOCK_M), K/V tokens per step (BLOCK_N), warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(head_dim_pad: int, dots_in: torch.dtype, kv_format: str, element_bytes: int,
                  arch: int | None, masked: bool = False) -> PrefillTiles:
    """The tile every launch uses unless one is passed (scripts/gpu_tile_sweep.py times alternatives).
    arch is the target's compute capability (90 for sm_90), None in the interpreter; masked: a Gemma layer
    (soft-capping or a sliding window), whose masks take registers of their own."""
    row_bytes = head_dim_pad * dots_in.itemsize
    if arch is not None and arch >= 90 and kv_format == "float" and dots_in.itemsize == 2 and head_dim_pad <= 128:
        # Hopper, 16-bit K/V up to head size 128: 64 query rows, 4 warps, K and V tiles of 16 KiB each.
        # Timed on an H100 (docs/GPU.md) against the tile below: 1.84-2.09x faster at head sizes 64 and 128,
        # with and without a cached prefix; 185 registers, no spill. On sm_80-sm_89 the same tile spills
        # (255 registers; python -m pagecli.attention.aot), so they keep the tile below.
        return PrefillTiles(64, min(128, 16384 // row_bytes), num_warps=4, num_stages=2)
    # Wide rows (fp32 from head_dim 128, 16-bit at 256) halve the query tile to keep registers unspilled.
    block_m = 64 if row_bytes <= 256 else 32
    if kv_format != "float" and dots_in == torch.float32:
        block_m = 16  # fp32 dots over widened bytes spill from 32 rows (python -m pagecli.attention.aot)
    # With 4 warps, a 64-row tile needs over 128 registers a thread (sm_80: 19% occupancy, or spills).
    num_warps = 8
    if kv_format != "float" and dots_in != torch.float32 and head_dim_pad >= 256:
        num_warps = 4  # 16-bit dots over a quantized cache at head size 256 spill 24 B at 8 warps on sm_86/89
        if masked:
            block_m = 16  # ... and with Gemma's masks 128 B at 32 rows on sm_80 (python -m pagecli.attention.aot)
    return PrefillTiles(block_m, kv_tile_tokens(head_dim_pad, element_bytes, most=32), num_warps, num_stages=2)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 bytes if int8/uint8)], new K stored
    v_cache: torch.Tensor,  # same shape and strides as k_cache, new V already stored
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, rows of query; need not start at 0
    seq_lens: torch.Tensor,  # [num_seqs] int32, prefix + new tokens
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; allocated when None
    tiles: PrefillTiles | None = None,  # None: prefill_tiles' choice
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    window: int | None = None,  # a query sees its last `window` positions only
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves (within a
    sliding window when given: a program reads no tile before its rows' windows).

    Only the query rows named by query_start_loc are written, so a caller can pass the
    offsets of the prefill part of a mixed batch together with the whole query and out.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert query_start_loc.shape == (num_seqs + 1,)
    assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride(), "k/v caches must share one layout"
    assert query.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert cache_head_dim(k_cache) == head_dim, "the cache's rows do not match head_dim"
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    kv_format = kv_format_of(k_cache)
    dots_in = dot_dtype(k_cache, query)
    if tiles is None:
        tiles = prefill_tiles(head_dim_pad, dots_in, kv_format, tile_element_bytes(k_cache), device_arch(query.device),
                              masked=window is not None or softcap is not None)
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim,
        window or 0,
        (softcap or 1.0) * LOG2_E,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=tiles.block_n,
        FP32_DOT=interpreting() or dots_in == torch.float32,
        KV_FORMAT=kv_format,
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
