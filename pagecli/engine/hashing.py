"""Stable block hashes for the prefix cache.

A block's hash is a digest of (parent block hash, the block's token ids); the chain is rooted
in the model fingerprint. blake2b gives the same value in every process (unlike Python's
salted `hash`), so hashes can be persisted by the disk store.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(model_fingerprint: str) -> bytes:
    return hashlib.blake2b(model_fingerprint.encode("utf-8"), digest_size=HASH_BYTES).digest()


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    tokens = array("q", token_ids).tobytes()  # int64, so any vocabulary size hashes the same way
    return hashlib.blake2b(parent_hash + tokens, digest_size=HASH_BYTES).digest()


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Hashes of the first num_blocks full blocks of token_ids."""
    hashes: list[bytes] = []
    parent = root
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
