"""Segmented LoRA products for a step of many adapters, in two launches per product (the S-LoRA/Punica
"SGMV" idea): `shrink` computes every adapter row's scale * x @ A_slot.T into a [rows, rank] float32 buffer,
`expand` adds t @ B_slot to the base product's output rows.

A step's adapter rows lie in segments (a run of rows of one adapter at one scale: models/lora_batch.py);
each segment is cut into tiles of at most BLOCK_M rows (`LoraTiles`), and one program takes one tile (and,
across the grid's second axis, one block of rank or output columns), reading its slot's A or B from the
loaded adapters' stacks (models/lora_slots.py: [slots, rank, in] and [slots, rank, out]). Rows of the base
model are in no tile and are not touched; a tile with slot -1 does nothing. BLOCK_M follows the step's
longest segment: 16 for decode steps (a few rows per adapter; tl.dot's minimum), up to 64 for a prompt's
chunk (32 in float32). Products accumulate in float32; float32 inputs use the IEEE dot (no TF32), and in Triton's
interpreter every input is widened first (kernels/common.py: its bf16 dot is wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagecli.kernels.common import fp32_dot, interpreting

MAX_BLOCK_M = 64  # rows per tile for long segments (max_block_m); a decode step's tiles take 16
BLOCK_K = 64  # shrink: input features per loop step (32 for float32, whose IEEE dot holds more registers)
MAX_BLOCK_R = 64  # shrink: rank columns per program (a fused qkv of rank 64 is 192: three programs)
BLOCK_R_EXPAND = 16  # expand: rank per loop step (ranks are small; 16 is tl.dot's minimum)
BLOCK_N = 64  # expand: output columns per program


@dataclass(frozen=True)
class LoraTiles:
    """A step's adapter rows as tiles of one segment each, on the device; built once per step, read by every
    layer's and product's launches."""

    meta: torch.Tensor  # [3, tiles] int32: each tile's first row, its number of rows (<= block_m), its slot
    scale: torch.Tensor  # [tiles] float32: its segment's scale
    num_tiles: int
    block_m: int


def max_block_m(dtype: torch.dtype) -> int:
    """Rows per tile for long segments: 64, or 32 for float32, whose IEEE dots at 64 rows hold 138-255 registers
    a thread (12-19% occupancy on sm_80 and sm_90: python -m pagecli.attention.aot_lora)."""
    return MAX_BLOCK_M // 2 if dtype == torch.float32 else MAX_BLOCK_M


def lora_tiles(segments: Sequence[tuple[int, int, int, float]], dtype: torch.dtype,
               device: torch.device | None) -> LoraTiles:
    """segments: (first row, one past the last, slot, scale) of each run of rows of one adapter and scale;
    dtype: the activations' (it bounds the tiles' rows)."""
    longest = max(end - start for start, end, _, _ in segments)
    block_m = min(max_block_m(dtype), max(16, triton.next_power_of_2(longest)))
    starts: list[int] = []
    counts: list[int] = []
    slots: list[int] = []
    scales: list[float] = []
    for start, end, slot, scale in segments:
        for tile_start in range(start, end, block_m):
            starts.append(tile_start)
            counts.append(min(block_m, end - tile_start))
            slots.append(slot)
            scales.append(scale)
    meta = torch.tensor([starts, counts, slots], dtype=torch.int32, device=device)  # [3, tiles]
    scale = torch.tensor(scales, dtype=torch.float32, device=device)  # [tiles]
    return LoraTiles(meta, scale, len(starts), block_m)


@triton.jit(do_not_specialize=["num_tiles"])  # the tile count changes every step: no recompiles
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [slots, rank, in_features]
    t_ptr,  # [num_tokens, rank] float32
    tile_meta_ptr,  # [3, tiles] int32: first row, rows, slot
    tile_scale_ptr,  # [tiles] float32
    num_tiles,
    in_features,
    rank,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_t_row,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_meta_ptr + 2 * num_tiles + tile)
    if slot < 0:
        return
    first_row = tl.load(tile_meta_ptr + tile).to(tl.int64)
    num_rows = tl.load(tile_meta_ptr + num_tiles + tile)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < rank
    x_rows = x_ptr + (first_row + rows)[:, None] * stride_x_row  # [BLOCK_M, 1]
    a_cols = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[None, :] * stride_a_rank  # [1, BLOCK_R]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_cols + ks[:, None], mask=k_mask[:, None] & rank_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        if FP32_DOT:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += fp32_dot(x, a, FP32_DOT)
    scale = tl.load(tile_scale_ptr + tile)
    t_offsets = (first_row + rows)[:, None] * stride_t_row + ranks[None, :]
    tl.store(t_ptr + t_offsets, acc * scale, mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit(do_not_specialize=["num_tiles"])
def _lora_expand_kernel(
    t_ptr,  # [num_tokens, rank] float32, the shrink's output
    b_ptr,  # [slots, rank, out_features]
    out_ptr,  # [num_tokens, out_features], added to in place
    tile_meta_ptr,  # [3, tiles] int32: first row, rows, slot
    num_tiles,
    out_features,
    rank,
    stride_t_row,
    stride_b_slot,
    stride_b_rank,
    stride_out_row,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tile_meta_ptr + 2 * num_tiles + tile)
    if slot < 0:
        return
    first_row = tl.load(tile_meta_ptr + tile).to(tl.int64)
    num_rows = tl.load(tile_meta_ptr + num_tiles + tile)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    t_rows = t_ptr + (first_row + rows)[:, None] * stride_t_row  # [BLOCK_M, 1]
    b_cols = b_ptr + slot.to(tl.int64) * stride_b_slot + cols[None, :]  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r_start in range(0, rank, BLOCK_R):
        rs = r_start + tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        t = tl.load(t_rows + rs[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
        b = tl.load(b_cols + rs[:, None] * stride_b_rank, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        if FP32_DOT:
            b = b.to(tl.float32)
        else:
            t = t.to(b.dtype)  # the tensor cores take 16-bit inputs; the sum stays float32
        acc += fp32_dot(t, b, FP32_DOT)
    out_ptrs = out_ptr + (first_row + rows)[:, None] * stride_out_row + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    out = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (out + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def shrink_block_k(dtype: torch.dtype) -> int:
    """The shrink's K tile: half for float32, whose IEEE dot keeps twice the bytes of a tile in registers."""
    return BLOCK_K // 2 if dtype == torch.float32 else BLOCK_K


def lora_add(
    out: torch.Tensor,  # [num_tokens, out_features]
    x: torch.Tensor,  # [num_tokens, in_features]
    a: torch.Tensor,  # [slots, rank, in_features]
    b: torch.Tensor,  # [slots, rank, out_features]
    tiles: LoraTiles,
) -> torch.Tensor:
    """out[row] += scale * (x[row] @ a[slot].T) @ b[slot] for every row of every tile; other rows unchanged.
    out is changed in place and returned."""
    num_tokens, in_features = x.shape
    slots, rank, out_features = b.shape
    assert a.shape == (slots, rank, in_features) and out.shape == (num_tokens, out_features)
    if x.stride(1) != 1:
        x = x.contiguous()
    assert out.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1, "out's and the stacks' rows must be contiguous"
    assert a.dtype == b.dtype == x.dtype, "the adapters' stacks take the activations' dtype"
    if tiles.num_tiles == 0 or rank == 0:
        return out
    fp32_dot_inputs = x.dtype == torch.float32 or interpreting()
    t = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)  # [num_tokens, rank]
    block_r = min(MAX_BLOCK_R, max(16, triton.next_power_of_2(rank)))
    _lora_shrink_kernel[(tiles.num_tiles, triton.cdiv(rank, block_r))](
        x, a, t, tiles.meta, tiles.scale, tiles.num_tiles, in_features, rank,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_K=shrink_block_k(x.dtype), BLOCK_R=block_r, FP32_DOT=fp32_dot_inputs,
        num_warps=4,
    )
    _lora_expand_kernel[(tiles.num_tiles, triton.cdiv(out_features, BLOCK_N))](
        t, b, out, tiles.meta, tiles.num_tiles, out_features, rank,
        t.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_R=BLOCK_R_EXPAND, BLOCK_N=BLOCK_N, FP32_DOT=fp32_dot_inputs,
        num_warps=4,
    )
    return out
