"""Attention over the paged KV cache with pagecli's compiled CPU kernels (pagecli.native), the reference
backend's PyTorch path for whatever they do not take.

Every decode sequence of the step is handled by one call that reads K/V straight from the blocks: the
per-sequence gather and SDPA call cost more than the arithmetic for a small model. With bf16 on a CPU
with AMX tiles, so are the prefilling sequences (1.6-2.6x PyTorch's SDPA on a step of many prompts or
of new tokens after cached ones, even on one long prompt; docs/BENCHMARKS.md), each row bit-identical
to what decoding its token gives; without AMX the prompts' tokens go through the decode kernel as
rows of their own, for the same reason: however a prompt is chunked, or split by a prefix hit, each
token's attention is the same bits. A quantized cache (--kv-dtype int8/fp8) is written by the compiled
store kernel (the same bytes as quantize_rows) and read widened in registers by the decode kernel.
"""

from __future__ import annotations

import torch

from pagecli.attention.metadata import AttentionMetadata
from pagecli.attention.reference_backend import ReferenceAttentionBackend
from pagecli.kv_format import format_of_cache
from pagecli.native.interface import CpuOps

SHORT_CHUNK_TOKENS = 16  # steps whose chunks are all this short run in the one-call decode step (one_call_rows)


class CpuAttentionBackend(ReferenceAttentionBackend):
    def __init__(self, cpu_ops: CpuOps) -> None:
        self.cpu_ops = cpu_ops

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        if format_of_cache(k_cache) is not None and self._native(key):
            self.cpu_ops.store_kv_quantized(key, k_cache, meta.slot_mapping)  # the same bytes as quantize_rows
            self.cpu_ops.store_kv_quantized(value, v_cache, meta.slot_mapping)
            return
        super().store_kv(key, value, k_cache, v_cache, meta)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
        out = torch.empty_like(query)
        if window is not None and meta.max_seq_len <= window:
            window = None  # every sequence of the step fits its window: the kernels' full attention is the same
        if softcap is not None or window is not None:
            # The compiled kernels have neither soft-capping nor a window: the PyTorch path for this layer.
            self._sequences(out, query, k_cache, v_cache, meta, scale, 0, softcap, window)
            return out
        if meta.num_decode_seqs < meta.num_seqs and self._prompts_as_decode_rows(query, k_cache):
            tables, lens = meta.token_rows()
            self.cpu_ops.paged_decode_attention(out, query, k_cache, v_cache, tables, lens, scale)
            return out
        first = 0
        if meta.num_decode_seqs and self.native_decode(query, k_cache):
            first = meta.num_decode_seqs  # decodes come first, one token each
            self.cpu_ops.paged_decode_attention(out[:first], query[:first], k_cache, v_cache,
                                                meta.block_tables, meta.seq_lens, scale)
        if first < meta.num_seqs and self._native_prefill(query, k_cache):
            self.cpu_ops.paged_prefill_attention(out[first:], query[first:], k_cache, v_cache,
                                                 meta.block_tables[first:], meta.seq_lens[first:],
                                                 meta.query_start_loc[first:], scale)
            return out
        self._sequences(out, query, k_cache, v_cache, meta, scale, first)
        return out

    def one_call_rows(self, h: torch.Tensor, kv_caches: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block tables and context lengths with which a one-call decode step (pagecli.native's
        DecodeStep) runs this step, or None where it cannot: every row a decode, or every chunk short
        (speculative decoding's drafts, a small budget's slices) with each token a decode row over its causal
        context (AttentionMetadata.token_rows). DecodeStep stores a layer's keys and values for every row
        before any row attends, so a draft's row sees the drafts before it; and each token gets what
        decoding it alone would, so a checking step's greedy choices are plain decoding's bit for bit."""
        if not self.native_decode(h, kv_caches):
            return None
        if meta.num_decode_seqs == meta.num_seqs:
            return meta.block_tables, meta.seq_lens
        if meta.max_query_len <= SHORT_CHUNK_TOKENS:
            return meta.token_rows()
        return None

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
        (AttentionMetadata.token_rows): wherever that kernel reads the cache and no prefill kernel of
        pagecli's own takes the step (AMX's, itself bit-identical to decoding). One call for the whole
        step, and a prompt's rows get exactly what decoding those tokens would, so neither chunking nor
        a prefix hit (the rest of a prompt after cached blocks) can change a bit: PyTorch's flash kernel
        splits its sums by the lengths it is given, and a prompt computed whole, in chunks or after a hit
        parted at near-ties (the greedy output of 1 of 20 editing requests changed on its second run,
        AVX2, float32). The price on AVX2 (the float32 kernel, one thread): none at 600-token prompts,
        9-12% of the prefill at 2,000-4,000 (docs/benchmarks/speculation.md); on a Zen 4 the AVX512-BF16
        kernel beats flash at 200-4,000-token prompts (1.1-1.7x)."""
        return self.native_decode(query, k_cache) and not self._native_prefill(query, k_cache)
