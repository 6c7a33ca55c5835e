"""Helpers the attention kernels share: the interpreter switch and an fp32-exact dot.

Triton's interpreter (TRITON_INTERPRET=1, how CI tests the kernels on CPU) computes
bf16 arithmetic and bf16 `tl.dot` wrongly, so the kernels upcast loaded values to
fp32 when interpreting. On a GPU they keep 16-bit inputs for the tensor cores and
accumulate in fp32; fp32 caches use the IEEE dot rather than TF32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# Bytes of one K (or V) tile a program loads per step. Larger tiles spill registers or exceed the
# SM's share for good occupancy on sm_80/sm_90 (python -m pagecli.kernels.aot checks; docs/GPU.md).
KV_TILE_BYTES = 8192

# @triton.jit picks interpreter or compiler when the kernel is decorated, i.e. when
# this package is imported; read the switch at the same moment so the two agree.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"


def interpreting() -> bool:
    """True when the kernels of this package run in Triton's CPU interpreter."""
    return INTERPRETING


def kv_tile_tokens(head_dim_pad: int, element_bytes: int, most: int) -> int:
    """Tokens per K/V tile: as many as fit KV_TILE_BYTES, at least 16 (tl.dot's minimum), at most `most`."""
    return max(16, min(most, KV_TILE_BYTES // (head_dim_pad * element_bytes)))


@triton.jit
def fp32_dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in fp32; IEEE fp32 products when FP32_DOT (no TF32 rounding)."""
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def paged_kv_offsets(
    table_row_ptr,  # this sequence's row of the block table
    positions,  # [BLOCK_N] context positions
    pos_mask,  # [BLOCK_N]
    dims,  # [D_PAD]
    stride_cache_block,
    stride_cache_slot,
    head_offset,  # kv_head * stride_cache_head
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets [BLOCK_N, D_PAD] of one KV head's rows at the given positions, through the block table."""
    block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    offsets = block_ids * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot + head_offset
    return offsets[:, None] + dims[None, :]


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    positions,  # [BLOCK_N]
    pos_mask,  # [BLOCK_N]
    dims,  # [D_PAD]
    dim_mask,  # [D_PAD]
    stride_cache_block,
    stride_cache_slot,
    head_offset,
    BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """K and V tiles [BLOCK_N, D_PAD] of one KV head at the given positions (zeros where masked)."""
    kv_offsets = paged_kv_offsets(
        table_row_ptr, positions, pos_mask, dims, stride_cache_block, stride_cache_slot, head_offset, BLOCK_SIZE
    )
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, v, FP32_DOT: tl.constexpr):
    """Fold one tile into the running softmax: scores [M, N] in the log2 domain, masked with -inf,
    and values [N, D]; m_i [M] is the running max, l_i [M] the running sum, acc [M, D] the output.
    Every row needs a finite score in its first tile, or the rescale computes -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + fp32_dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l_i, acc
