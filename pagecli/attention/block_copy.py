"""Copying whole KV blocks inside the pool: the copy-on-write step of forked sequences.

One rule for every backend and device: block `dst[i]` gets block `src[i]`'s K and V in every
layer. The gather on the right is materialised before the write, so a block that is a source
and a destination in the same call still gives its old contents.
"""

from __future__ import annotations

import torch


def copy_blocks(kv_caches: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; copies src[i] -> dst[i]."""
    if not src:
        return
    device = kv_caches.device
    src_ids = torch.tensor(src, dtype=torch.long, device=device)  # [num_copies]
    dst_ids = torch.tensor(dst, dtype=torch.long, device=device)
    kv_caches.index_copy_(2, dst_ids, kv_caches.index_select(2, src_ids))
