"""Triton kernels for attention over the paged KV cache: KV store, paged decode, prefill over a paged prefix."""

from pagecli.kernels.decode import paged_decode_attention
from pagecli.kernels.prefill import paged_prefill_attention
from pagecli.kernels.store_kv import store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
