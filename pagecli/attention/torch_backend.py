"""Attention over the paged KV cache in plain PyTorch: the CPU path and the fallback everywhere.

Writes new K/V with one indexed copy into the flat slot view of the cache, then runs
scaled dot-product attention per sequence over the blocks its block table names.
For decode, the query heads that share a KV head are folded into the query length
(`[kv_heads, group, head_dim]`), which needs no mask and no K/V repeat.

On the CPU, when pagecli's compiled kernels are available (pagecli.native), every decode
sequence of the step is handled by one call that reads K/V straight from the blocks: the
per-sequence gather and SDPA call cost more than the arithmetic for a small model. With bf16
on a CPU with AMX tiles, so are the prefilling sequences (1.6-2.6x PyTorch's SDPA on a step of
many prompts or of new tokens after cached ones, even on one long prompt; docs/BENCHMARKS.md),
each row bit-identical to what decoding its token gives.

A quantized cache (--kv-dtype int8/fp8, kv_format.py) is written quantized (by the compiled store
kernel, else by quantize_rows: the same bytes) and read widened: by the decode kernel in registers,
elsewhere by dequantizing the gathered rows before PyTorch's attention. A float cache in another
dtype than the model's (--kv-dtype float16 with a bfloat16 model, say) is widened the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagecli.attention.block_copy import copy_blocks
from pagecli.attention.kv_format import dequantize_rows, format_of_cache, quantize_rows
from pagecli.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, cpu_ops: Any = None) -> None:
        self.cpu_ops = cpu_ops  # pagecli.native.cpu_ops(), or None for the plain PyTorch path

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        slots = meta.slot_mapping
        kind = format_of_cache(k_cache)
        if kind is not None and self._native(key):
            self.cpu_ops.store_kv_quantized(key, k_cache, slots)  # the same bytes as quantize_rows
            self.cpu_ops.store_kv_quantized(value, v_cache, slots)
            return
        flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])  # [num_slots, kv_heads, row]
        flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        if slots.numel() and bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        if kind is not None:
            key, value = quantize_rows(key, kind), quantize_rows(value, kind)
        flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, value.to(flat_v.dtype))

    def copy_blocks(self, kv_caches: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: block dst[i] of every layer gets block src[i] (block_copy.py, one rule everywhere)."""
        copy_blocks(kv_caches, src, dst)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        flat_k = k_cache.view(-1, num_kv_heads, k_cache.shape[3])  # [num_slots, kv_heads, row]
        flat_v = v_cache.view(-1, num_kv_heads, k_cache.shape[3])
        start = 0
        first = 0
        if meta.num_decode_seqs < meta.num_seqs and self._prompts_as_decode_rows(query, k_cache):
            tables, lens = meta.token_rows()
            self.cpu_ops.paged_decode_attention(out, query, k_cache, v_cache, tables, lens, scale)
            return out
        if meta.num_decode_seqs and self.native_decode(query, k_cache):
            first = start = meta.num_decode_seqs  # decodes come first, one token each
            self.cpu_ops.paged_decode_attention(out[:first], query[:first], k_cache, v_cache,
                                                meta.block_tables, meta.seq_lens, scale)
        if first < meta.num_seqs and self._native_prefill(query, k_cache):
            self.cpu_ops.paged_prefill_attention(out[start:], query[start:], k_cache, v_cache,
                                                 meta.block_tables[first:], meta.seq_lens[first:],
                                                 meta.query_start_loc[first:], scale)
            return out
        for i in range(first, meta.num_seqs):
            q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
            q = query[start : start + q_len]
            slots = meta.context_slots(i, k_cache.shape[1])
            # [kv_heads, seq_len, head_dim] in the query's dtype (a quantized or other-dtype cache is widened)
            k = dequantize_rows(flat_k.index_select(0, slots), query.dtype).transpose(0, 1)
            v = dequantize_rows(flat_v.index_select(0, slots), query.dtype).transpose(0, 1)
            if q_len == 1:
                q_folded = q.view(num_kv_heads, group, head_dim)  # [kv_heads, group, head_dim]
                o = F.scaled_dot_product_attention(q_folded, k, v, scale=scale)
                out[start] = o.reshape(num_heads, head_dim)
            else:
                o = self._prefill_one(q.transpose(0, 1), k, v, seq_len, scale)
                out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    def _native(self, rows: torch.Tensor) -> bool:
        """Whether pagecli's compiled kernels run these rows (on the CPU, when they are built)."""
        return self.cpu_ops is not None and rows.device.type == "cpu"

    def native_decode(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """The compiled decode kernel reads caches in the query's dtype, or quantized ones."""
        return self._native(query) and (format_of_cache(k_cache) is not None or k_cache.dtype == query.dtype)

    def _native_prefill(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (self.cpu_ops is not None and query.device.type == "cpu"
                and self.cpu_ops.paged_prefill_supported(query, k_cache))

    def _prompts_as_decode_rows(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether prompts go through the decode kernel, every token a row over its causal context
        (AttentionMetadata.token_rows): one call for the whole step, and a prompt's rows get exactly
        what decoding those tokens would, so chunking cannot change a bit. Done where that kernel is
        the AVX512-BF16 one (a bf16 query over a bf16 cache without AMX, or over an int8/fp8 cache):
        on a Zen 4 it beats PyTorch's flash kernel at 200-4,000-token prompts (1.1-1.7x; one
        4,000-token prompt with an int8 cache 6.5 s against 9.1, fp8 6.0 against 8.4) and its
        masked path for chunks after a cached prefix by more. The float32 decode kernel of AVX2 loses
        to flash on long prompts, and AMX has a prefill kernel of its own for bf16 caches."""
        return (self._native(query) and not self._native_prefill(query, k_cache)
                and self.cpu_ops.paged_decode_bf16_supported(query, k_cache))

    @staticmethod
    def _prefill_one(
        q: torch.Tensor,  # [num_heads, q_len, head_dim]
        k: torch.Tensor,  # [kv_heads, seq_len, head_dim]
        v: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        # 4-D inputs ([1, heads, len, head_dim]): PyTorch's CPU flash kernel takes only those
        # (3-D ones fall back to a path about 6x slower); enable_gqa avoids repeating K/V per group.
        q, k, v = q[None], k[None], v[None]
        q_len = q.shape[2]
        if q_len == seq_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0]
        # New tokens follow a cached prefix: token j may see positions <= prefix_len + j.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos, scale=scale, enable_gqa=True)[0]
