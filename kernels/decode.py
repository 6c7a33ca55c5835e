"""Paged decode attention: one query token per sequence against its whole cached context.

One program serves all query heads that share a KV head (GQA), padded to at least 16
rows so `tl.dot` can run, and walks the context in tiles of BLOCK_N tokens through the
block table with an fp32 online softmax. When batch * kv_heads is too small to fill
the GPU, each sequence's context is split across programs (flash-decoding) and a
second kernel merges the partial results by their log-sum-exp. The launch grid is
(batch, kv_heads, num_splits) whatever the lengths, so the launch can be captured in
a CUDA graph: each program derives its token range from seq_len on the device, and a
split past the end of its sequence writes an empty result (LSE = -inf).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagecli.kernels.common import (
    LOG2_E,
    cache_head_dim,
    dot_dtype,
    fp32_dot,
    interpreting,
    kv_format_of,
    kv_tile_tokens,
    load_kv_tile,
    load_quantized_kv_tile,
    online_softmax_step,
    soft_cap,
    tile_element_bytes,
)

MAX_SPLITS = 16  # beyond this the merge costs more than the extra parallelism gains
MIN_SPLIT_TOKENS = 256  # a shorter split spends more on its own setup and merge than on its tokens


@triton.jit
def _decode_kernel(
    query_ptr,  # [batch, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], or head_dim + 2 bytes when quantized
    v_cache_ptr,
    block_tables_ptr,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch] int32
    out_ptr,  # [batch, num_heads, head_dim] when NUM_SPLITS == 1, else [batch, num_heads, NUM_SPLITS, head_dim] fp32
    lse_ptr,  # [batch, num_heads, NUM_SPLITS] fp32, log2 domain; unused when NUM_SPLITS == 1
    qk_scale,  # softmax scale * log2(e)
    stride_query_seq,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    head_dim,
    min_split_tokens,
    window,  # with SLIDING: the query sees its sequence's last `window` positions only
    softcap_log2,  # with SOFTCAP: the cap times log2(e); scores become cap * tanh(score / cap)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= 16 and a power of two, for tl.dot
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "float" (the cache's dtype), "int8" or "fp8" (common.load_quantized_kv_tile)
    SLIDING: tl.constexpr = False,  # a sliding-window layer (Gemma): positions before the window are not read
    SOFTCAP: tl.constexpr = False,  # soft-capped scores (Gemma 2)
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # the first position the query sees
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    if NUM_SPLITS == 1:
        # Tile-aligned (a window's unaligned start made ptxas spill on sm_80); positions before `first` are
        # masked, never loaded.
        start = first // BLOCK_N * BLOCK_N
        end = seq_len
    else:
        # Tile-aligned, at least min_split_tokens long: short contexts leave the later splits empty.
        split_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        split_len = tl.maximum(split_len, min_split_tokens)
        start = first + split * split_len
        end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim

    q_offsets = seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    if FP32_DOT:
        q = q.to(tl.float32)
    elif KV_FORMAT == "float":
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_cache_head
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = positions < end
        if SLIDING:
            pos_mask = pos_mask & (positions >= first)
        if KV_FORMAT == "float":
            k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, positions, pos_mask, dims, dim_mask,
                stride_cache_block, stride_cache_slot, head_offset, BLOCK_SIZE, FP32_DOT,
            )  # [BLOCK_N, D_PAD] each
            scores = fp32_dot(q, tl.trans(k), FP32_DOT) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
        else:
            k, k_scale, v = load_quantized_kv_tile(
                k_cache_ptr, v_cache_ptr, table_row, positions, pos_mask, dims, dim_mask,
                stride_cache_block, stride_cache_slot, head_offset, head_dim, q.dtype, BLOCK_SIZE, KV_FORMAT,
            )  # [BLOCK_N, D_PAD], [BLOCK_N], [BLOCK_N, D_PAD]
            scores = fp32_dot(q, tl.trans(k), FP32_DOT) * (k_scale * qk_scale)[None, :]  # log2 domain
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))  # each tile has a valid position
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, FP32_DOT)

    # A sequence of length 0 (a padded batch row) or an empty split leaves l_i == 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + split * stride_out_split + dims[None, :]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        lse_offsets = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_offsets, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # [batch, num_heads, NUM_SPLITS, head_dim] fp32
    lse_ptr,  # [batch, num_heads, NUM_SPLITS] fp32, log2 domain
    out_ptr,  # [batch, num_heads, head_dim]
    stride_out_seq,
    stride_out_head,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head

    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < head_dim

    lse = tl.load(lse_ptr + row * NUM_SPLITS + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: output zeros
    weights = tl.exp2(lse - lse_max)  # empty splits weigh 0
    nonempty = (lse > float("-inf"))[:, None] & dim_mask[None, :]
    partial = tl.load(
        partial_ptr + (row * NUM_SPLITS + splits[:, None]) * head_dim + dims[None, :], mask=nonempty, other=0.0
    )  # [SPLITS_PAD, D_PAD]
    total = tl.sum(weights, axis=0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    out_offsets = seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence so that batch * kv_heads * splits reaches about two programs per SM.

    Depends only on the batch shape, never on lengths, so a captured graph stays valid.
    """
    if device.type != "cuda":
        return 1
    target_programs = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    programs = batch * num_kv_heads
    if programs >= target_programs:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(math.ceil(target_programs / programs)))


class DecodeTiles(NamedTuple):
    """A launch's tile: K/V tokens per step (BLOCK_N), warps, pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim_pad: int, element_bytes: int, masked: bool = False, quantized: bool = False) -> DecodeTiles:
    """The tile every launch uses unless one is passed (scripts/gpu_tile_sweep.py times alternatives).
    masked: a Gemma layer (soft-capping or a sliding window): over a quantized cache at head size 256 its
    4 warps spilled 8 B on sm_90, 8 warps none (python -m pagecli.attention.aot)."""
    num_warps = 8 if masked and quantized and head_dim_pad >= 256 else 4
    return DecodeTiles(kv_tile_tokens(head_dim_pad, element_bytes, most=64), num_warps=num_warps, num_stages=2)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 scale bytes when int8/uint8)]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32, context length including the query token
    scale: float,
    num_splits: int | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim]; allocated when None
    tiles: DecodeTiles | None = None,  # None: decode_tiles' choice
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    window: int | None = None,  # the query sees its last `window` positions only
) -> torch.Tensor:
    """Attention of each sequence's single new token over its first seq_len cached positions (the last
    `window` of them for a sliding layer: the splits share those out, nothing before them is read).

    num_splits is the fixed number of programs per (sequence, kv head); None picks it from
    the batch shape and the GPU. Each split covers at least min_split_tokens positions.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride(), "k/v caches must share one layout"
    assert query.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    assert cache_head_dim(k_cache) == head_dim, "the cache's rows do not match head_dim"
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, query.device)
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if num_splits == 1:
        partial, lse, stride_split = out, out, 0  # written directly; no LSE
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        stride_split = partial.stride(2)
    kv_format = kv_format_of(k_cache)
    dots_in = dot_dtype(k_cache, query)
    if tiles is None:
        tiles = decode_tiles(head_dim_pad, tile_element_bytes(k_cache), masked=window is not None or softcap is not None,
                             quantized=kv_format != "float")
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial,
        lse,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        stride_split,
        head_dim,
        min_split_tokens,
        window or 0,
        (softcap or 1.0) * LOG2_E,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_N=tiles.block_n,
        NUM_SPLITS=num_splits,
        FP32_DOT=interpreting() or dots_in == torch.float32,
        KV_FORMAT=kv_format,
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            partial,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=4,
        )
    return out
