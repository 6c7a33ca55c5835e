"""Helpers the attention kernels share: the interpreter switch, an fp32-exact dot, loading K/V tiles,
and the int8/fp8 row format of a quantized cache (pagecli/kv_format.py) in both directions.

Triton's interpreter (TRITON_INTERPRET=1, how CI tests the kernels on CPU) computes
bf16 arithmetic and bf16 `tl.dot` wrongly, so the kernels upcast loaded values to
fp32 when interpreting. On a GPU they keep 16-bit inputs for the tensor cores and
accumulate in fp32; fp32 caches use the IEEE dot rather than TF32.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from pagecli.kv_format import SCALE_BYTES, format_of_cache

LOG2_E = 1.4426950408889634
# Bytes of one K (or V) tile a program loads per step. Larger tiles spill registers or exceed the
# SM's share for good occupancy on sm_80/sm_90 (python -m pagecli.attention.aot checks; docs/GPU.md).
KV_TILE_BYTES = 8192

# @triton.jit picks interpreter or compiler when the kernel is decorated, i.e. when
# this package is imported; read the switch at the same moment so the two agree.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "") == "1"


def interpreting() -> bool:
    """True when the kernels of this package run in Triton's CPU interpreter."""
    return INTERPRETING


_target_arch: int | None = None  # set by kernels.aot while it records launches on meta tensors


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def device_arch(device: torch.device) -> int | None:
    """The compute capability (90 for sm_90) a launch on this device compiles for; None off CUDA (the
    interpreter), unless `targeting` names one."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    return _target_arch


@contextlib.contextmanager
def targeting(arch: int | None) -> Iterator[None]:
    """Launches on meta or CPU tensors choose their tiles as on sm_<arch> (kernels.aot records per target)."""
    global _target_arch
    previous, _target_arch = _target_arch, arch
    try:
        yield
    finally:
        _target_arch = previous


def kv_format_of(cache: torch.Tensor) -> str:
    """The KV_FORMAT constexpr for a cache tensor: 'int8' or 'fp8' (quantized, by its dtype) or 'float'."""
    return format_of_cache(cache) or "float"


def cache_head_dim(cache: torch.Tensor) -> int:
    """head_dim of a cache [num_blocks, block_size, kv_heads, row]: the row less the scale when quantized."""
    if format_of_cache(cache) is None:
        return cache.shape[3]
    # Rows start on even bytes (an even row width), so the scale loads through a float16 pointer.
    aligned = cache.data_ptr() % 2 == 0 and all(stride % 2 == 0 for stride in cache.stride()[:3])
    assert cache.shape[3] % 2 == 0 and aligned, "quantized rows must start on even bytes"
    return cache.shape[3] - SCALE_BYTES


def dot_dtype(cache: torch.Tensor, query: torch.Tensor) -> torch.dtype:
    """The dtype K and V enter the dots in: the cache's own, or for a quantized cache the query's (its data
    widens to it: load_quantized_kv_tile)."""
    return cache.dtype if format_of_cache(cache) is None else query.dtype


def tile_element_bytes(cache: torch.Tensor) -> int:
    """Bytes a K/V tile takes per element in registers, which bounds its size: the cache's element, or 4 for
    a quantized cache, whose V is scaled in fp32 (wider tiles spill or use over 160 registers on sm_80)."""
    return cache.element_size() if format_of_cache(cache) is None else 4


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
def paged_kv_rows(
    table_row_ptr,  # this sequence's row of the block table
    positions,  # [BLOCK_N] context positions
    pos_mask,  # [BLOCK_N]
    stride_cache_block,
    stride_cache_slot,
    head_offset,  # kv_head * stride_cache_head
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets [BLOCK_N] of the start of one KV head's rows at the given positions, through the block table."""
    block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    return block_ids * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot + head_offset


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
    rows = paged_kv_rows(table_row_ptr, positions, pos_mask, stride_cache_block, stride_cache_slot, head_offset,
                         BLOCK_SIZE)
    kv_offsets = rows[:, None] + dims[None, :]
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if FP32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def load_quantized_kv_tile(
    k_cache_ptr,  # int8 or uint8 (fp8) rows of head_dim data bytes and a float16 scale
    v_cache_ptr,
    table_row_ptr,
    positions,  # [BLOCK_N]
    pos_mask,  # [BLOCK_N]
    dims,  # [D_PAD]
    dim_mask,  # [D_PAD]
    stride_cache_block,
    stride_cache_slot,
    head_offset,
    head_dim,
    dot_dtype: tl.constexpr,  # the query's dtype in the dots (fp32 when FP32_DOT)
    BLOCK_SIZE: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "int8" or "fp8"
):
    """From a quantized cache: K's data [BLOCK_N, D_PAD] in dot_dtype with its scale [BLOCK_N] (fp32), for the
    caller to apply to the scores, and V [BLOCK_N, D_PAD] dequantized in dot_dtype. Zeros where masked.

    K's data widens exactly (int8, and fp8 as e4m3/256, fit fp16, bf16 and fp32), so q . k_data is the
    exact-input dot and the scale multiplies its fp32 result. V is scaled before its dot rather than by
    folding the scale into the softmax weights: p * scale can fall below fp16's normal range.
    """
    rows = paged_kv_rows(table_row_ptr, positions, pos_mask, stride_cache_block, stride_cache_slot, head_offset,
                         BLOCK_SIZE)
    rows = tl.multiple_of(rows, 2)  # rows start on even bytes (host-checked), so data loads pair up
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k_data = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0)
    v_data = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0)
    k_scale = load_row_scales(k_cache_ptr, rows, head_dim, pos_mask, KV_FORMAT)
    v_scale = load_row_scales(v_cache_ptr, rows, head_dim, pos_mask, KV_FORMAT)
    k = widen_quantized(k_data, KV_FORMAT).to(dot_dtype)
    v = (widen_quantized(v_data, KV_FORMAT).to(tl.float32) * v_scale[:, None]).to(dot_dtype)
    return k, k_scale, v


@triton.jit
def load_row_scales(cache_ptr, rows, head_dim, mask, KV_FORMAT: tl.constexpr):
    """The fp32 factor [BLOCK_N] that turns widened data (widen_quantized) into values: the row's float16 scale,
    times 256 for fp8 (its data widens to e4m3 / 256)."""
    scale_ptrs = (cache_ptr + rows + head_dim).to(tl.pointer_type(tl.float16))
    scale = tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)
    if KV_FORMAT == "fp8":
        scale = scale * 256.0
    return scale


@triton.jit
def widen_quantized(data, KV_FORMAT: tl.constexpr):
    """int8 data as it is; fp8 (e4m3fn bytes) as float16 by moving the bits: sign to bit 15, exponent and
    mantissa up by 7, which is the e4m3 value / 256 exactly (subnormals too) and needs no fp8 arithmetic."""
    if KV_FORMAT == "fp8":
        byte = data.to(tl.uint16)
        bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True)
    else:
        return data


@triton.jit
def quantize_rows(x, KV_FORMAT: tl.constexpr):
    """Rows x [R, D_PAD] fp32 (zeros past head_dim) -> (data [R, D_PAD] int8 or uint8 e4m3fn bits, scale [R]
    float16), the bytes of kv_format.quantize_rows: IEEE divisions (div_rn; `/` is approximate on a GPU),
    round half to even, and no multiply that feeds an add (which a GPU would fuse into one rounding)."""
    if KV_FORMAT == "int8":
        limit: tl.constexpr = 127.0  # the largest |data| of the format (kv_format.py)
    else:
        limit: tl.constexpr = 448.0
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.math.div_rn(amax, limit).to(tl.float16)
    scale32 = scale.to(tl.float32)
    inverse = tl.where(scale32 > 0, tl.math.div_rn(1.0, tl.where(scale32 > 0, scale32, 1.0)), 0.0)
    scaled = tl.minimum(tl.maximum(x * inverse[:, None], -limit), limit)
    if KV_FORMAT == "int8":
        data = round_half_even(scaled).to(tl.int8)
    else:
        data = e4m3fn_bits(scaled)
    return data, scale


@triton.jit
def round_half_even(y):
    """fp32 y with |y| < 2**22 rounded to the nearest integer, ties to even (as torch.round), in fp32.
    Truncate, then step away from zero past half or at half from an odd integer: exact, and no libdevice
    call, which the interpreter lacks."""
    truncated = y.to(tl.int32)
    whole = truncated.to(tl.float32)
    fraction = tl.abs(y - whole)  # exact: the bits of y below its binary point
    away = (fraction > 0.5) | ((fraction == 0.5) & ((truncated & 1) != 0))
    return tl.where(away, whole + tl.where(y < 0, -1.0, 1.0), whole)


@triton.jit
def e4m3fn_bits(y):
    """fp32 y with |y| <= 448 -> its float8_e4m3fn byte (uint8), rounded to nearest even as torch converts.
    Normal results (|y| >= 2**-6) round the fp32 bits at mantissa bit 20 and rebias the exponent (127 -> 7);
    smaller ones are subnormal multiples of 2**-9, whose count 0..8 is the byte (8 is the smallest normal)."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    subnormal = round_half_even(tl.abs(y) * 512.0).to(tl.int32)
    code = tl.where(magnitude >= (127 - 6) << 23, normal, subnormal)
    sign = tl.where(bits < 0, 0x80, 0)
    return (code | sign).to(tl.uint8)


@triton.jit
def soft_cap(scores, softcap_log2):
    """Gemma 2's soft-capping in the log2 domain: scores are s * log2(e), softcap_log2 is cap * log2(e), and
    the result is cap * tanh(s / cap) * log2(e). tanh from exp2 (no libdevice in the interpreter):
    tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|). The divisions are the fast ones (an IEEE division's
    slow path costs a stack frame: ptxas counted it as a spill on sm_80)."""
    x = tl.fdiv(scores, softcap_log2, ieee_rounding=False)
    a = tl.exp2(-2.8853900817779268 * tl.abs(x))  # e^-2|x| = 2^(-2 log2(e) |x|)
    t = tl.fdiv(1.0 - a, 1.0 + a, ieee_rounding=False)
    return tl.where(x < 0, -t, t) * softcap_log2


@triton.jit
def online_softmax_step_rows_may_be_empty(m_i, l_i, acc, scores, v, FP32_DOT: tl.constexpr):
    """online_softmax_step for tiles where a row may have no visible position (a sliding window behind the
    tile): such a row keeps m_i = -inf, l_i = 0 and acc = 0 instead of computing -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + fp32_dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l_i, acc


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
