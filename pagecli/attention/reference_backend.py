"""Attention over the paged KV cache in plain PyTorch: the reference, and the path wherever no kernel of
pagecli's runs (no CPU kernels built, or a step they do not take; cpu_backend.py builds on it).

Writes new K/V with one indexed copy into the flat slot view of the cache, then runs
scaled dot-product attention per sequence over the blocks its block table names.
For decode, the query heads that share a KV head are folded into the query length
(`[kv_heads, group, head_dim]`), which needs no mask and no K/V repeat.

Soft-capping (scores -> cap * tanh(scores / cap), Gemma 2) and a sliding window (a query at position p
attends to positions p - window + 1 .. p, Gemma's sliding layers) are applied here, for the backends
whose kernels have neither: a windowed sequence gathers only the slots its window can reach, so nothing
outside it is read, with any prefix cached, chunk size or block layout.

A quantized cache (--kv-dtype int8/fp8, kv_format.py) is written quantized (quantize_rows) and read
widened: the gathered rows are dequantized before PyTorch's attention. A float cache in another
dtype than the model's (--kv-dtype float16 with a bfloat16 model, say) is widened the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagecli.attention.block_copy import copy_blocks
from pagecli.kv_format import dequantize_rows, format_of_cache, quantize_rows
from pagecli.attention.metadata import AttentionMetadata


class ReferenceAttentionBackend:
    name = "torch"  # what --attention calls it (the CPU backend answers to it too)
    cpu_ops = None  # no compiled kernels (CpuAttentionBackend has them)

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
        softcap: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        self._sequences(out, query, k_cache, v_cache, meta, scale, 0, softcap, window)
        return out

    def _sequences(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, first: int, softcap: float | None = None,
                   window: int | None = None) -> None:
        """Sequences first.. of the step, one SDPA call each, into out (their rows follow the first
        sequences', which take one row each: decodes come first)."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        flat_k = k_cache.view(-1, num_kv_heads, k_cache.shape[3])  # [num_slots, kv_heads, row]
        flat_v = v_cache.view(-1, num_kv_heads, k_cache.shape[3])
        start = first
        for i in range(first, meta.num_seqs):
            q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
            q = query[start : start + q_len]
            slots = meta.context_slots(i, k_cache.shape[1])
            # The first position any of these queries may see: all of them, or the first one's window.
            first_key = 0 if window is None else max(0, seq_len - q_len - window + 1)
            slots = slots[first_key:]
            # [kv_heads, seq_len - first_key, head_dim] in the query's dtype (a quantized or other-dtype
            # cache is widened)
            k = dequantize_rows(flat_k.index_select(0, slots), query.dtype).transpose(0, 1)
            v = dequantize_rows(flat_v.index_select(0, slots), query.dtype).transpose(0, 1)
            if softcap is not None or (window is not None and q_len > 1):
                o = _masked_attention(q.transpose(0, 1), k, v, seq_len, first_key, scale, softcap, window)
                out[start : start + q_len] = o.transpose(0, 1)
            elif q_len == 1:
                q_folded = q.view(num_kv_heads, group, head_dim)  # [kv_heads, group, head_dim]
                o = F.scaled_dot_product_attention(q_folded, k, v, scale=scale)
                out[start] = o.reshape(num_heads, head_dim)
            else:
                o = self._prefill_one(q.transpose(0, 1), k, v, seq_len, scale)
                out[start : start + q_len] = o.transpose(0, 1)
            start += q_len

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


def _masked_attention(
    q: torch.Tensor,  # [num_heads, q_len, head_dim]
    k: torch.Tensor,  # [kv_heads, num_keys, head_dim]: positions first_key .. seq_len - 1
    v: torch.Tensor,
    seq_len: int,
    first_key: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of the last q_len positions, with a window and soft-capped scores: in float32, as
    the reference implementations compute soft-capped scores. [num_heads, q_len, head_dim]"""
    num_heads, q_len, _ = q.shape
    group = num_heads // k.shape[0]
    k32 = k.float().repeat_interleave(group, dim=0)  # [num_heads, num_keys, head_dim]
    v32 = v.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), k32.transpose(1, 2)) * scale  # [num_heads, q_len, num_keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)  # [q_len, 1]
    k_pos = torch.arange(first_key, seq_len, device=q.device).unsqueeze(0)  # [1, num_keys]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v32).to(q.dtype)
