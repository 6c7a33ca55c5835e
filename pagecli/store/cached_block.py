"""The record the engine hands the disk tier for each block to persist (engine/kv_cache_manager makes them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachedBlock:
    """A full block the pool holds under its chained hash: what the disk tier needs to persist it."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes
    depth: int  # position in the chain: block `depth` holds tokens [depth * block_size, (depth + 1) * block_size)
    token_ids: tuple[int, ...]
