"""Attention over the paged KV cache with our Triton kernels (pagecli.kernels): the CUDA path.

A step's batch holds decodes first, then prefills. The decode kernel serves the first
meta.num_decode_seqs sequences and the prefill kernel the rest; both write into one
output tensor, and neither reads a length back to the host.
"""

from __future__ import annotations

import torch

from pagecli.attention.block_copy import copy_blocks
from pagecli.attention.metadata import AttentionMetadata
from pagecli.kernels import paged_decode_attention, paged_prefill_attention, store_kv


class TritonAttentionBackend:
    name = "triton"

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)

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
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        num_decodes = meta.num_decode_seqs
        if num_decodes > 0:
            paged_decode_attention(
                query[:num_decodes],
                k_cache,
                v_cache,
                meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes],
                scale,
                out=out[:num_decodes],
                softcap=softcap,
                window=window,
            )
        if num_decodes < meta.num_seqs:
            # Offsets stay absolute rows of query/out, so the prefill part needs no shift.
            paged_prefill_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables[num_decodes:],
                meta.query_start_loc[num_decodes:],
                meta.seq_lens[num_decodes:],
                scale,
                meta.max_query_len,
                out=out,
                softcap=softcap,
                window=window,
            )
        return out
