"""Writing this step's new keys and values into the paged KV cache, one token per program.

A token's flat slot is `block_id * block_size + offset`; slot -1 marks a padding token
and is skipped. Slots are int64, so caches past 2**31 elements address correctly.
A quantized cache (int8 or fp8 rows with a float16 scale, pagecli/kv_format.py)
is written quantized: each (token, kv head) row gets its scale and data bytes here, the
same bytes as kv_format.quantize_rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli.kernels.common import cache_head_dim, kv_format_of, quantize_rows


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim], or head_dim + 2 bytes when quantized
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    num_kv_heads,
    head_dim,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # "float" (the cache's dtype), "int8" or "fp8"
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    rows = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head  # [HEADS_PAD]
    cache_offsets = rows[:, None] + dims[None, :]
    if KV_FORMAT == "float":
        tl.store(k_cache_ptr + cache_offsets, key, mask=mask)
        tl.store(v_cache_ptr + cache_offsets, value, mask=mask)
    else:
        head_mask = heads < num_kv_heads
        k_data, k_scale = quantize_rows(tl.where(mask, key.to(tl.float32), 0.0), KV_FORMAT)
        v_data, v_scale = quantize_rows(tl.where(mask, value.to(tl.float32), 0.0), KV_FORMAT)
        tl.store(k_cache_ptr + cache_offsets, k_data, mask=mask)
        tl.store(v_cache_ptr + cache_offsets, v_data, mask=mask)
        # The scale follows the row's data bytes; rows start on even bytes, so it is a float16 store.
        tl.store((k_cache_ptr + rows + head_dim).to(tl.pointer_type(tl.float16)), k_scale, mask=head_mask)
        tl.store((v_cache_ptr + rows + head_dim).to(tl.pointer_type(tl.float16)), v_scale, mask=head_mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim (+ 2 scale bytes when int8/uint8)]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Copy each token's K/V rows into its cache slot: in the cache dtype, or quantized for an int8/fp8 cache."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_format = kv_format_of(k_cache)
    assert cache_head_dim(k_cache) == head_dim, "the cache's rows do not match head_dim"
    if kv_format == "float":
        # Cast outside the kernel: torch rounds to nearest even, the interpreter's cast truncates.
        key = key.to(k_cache.dtype)
        value = value.to(v_cache.dtype)
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride(), "k/v caches must share one layout"
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        num_kv_heads,
        head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FORMAT=kv_format,
        num_warps=4,
    )
