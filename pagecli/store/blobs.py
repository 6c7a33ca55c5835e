"""A blob: one full KV block, all layers, as a safetensors file, and its checksum.

The file holds one tensor "kv" [num_layers, 2 (K, V), block_size, kv_heads, head_dim] in the
cache dtype, and one metadata entry naming the format, the cache layout version and the block
hash (one entry, because safetensors writes several in no fixed order, and equal blocks
should give equal bytes). Reading
verifies the checksum before parsing and the metadata and shape after: a blob that is not
exactly the block its index row names raises BadBlob. safetensors only: no pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pagecli.models.fingerprint import CACHE_LAYOUT_VERSION
from pagecli.store.files import checksum

BLOB_FORMAT = "pagecli-kv-block"
_METADATA_KEY = "pagecli"


class BadBlob(Exception):
    """A blob is missing, truncated, altered, or holds another block."""


@dataclass(frozen=True)
class BlockGeometry:
    """The shape and dtype every blob of one model must have."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.kv_heads, self.head_dim)


def _label(block_hash: bytes) -> str:
    return f"{BLOB_FORMAT};layout={CACHE_LAYOUT_VERSION};block_hash={block_hash.hex()}"


def encode_block(kv: torch.Tensor, block_hash: bytes) -> bytes:
    """safetensors bytes of one block's KV [num_layers, 2, block_size, kv_heads, head_dim]."""
    return st_save({"kv": kv.contiguous()}, metadata={_METADATA_KEY: _label(block_hash)})


def decode_block(data: bytes, expected_checksum: str, block_hash: bytes, geometry: BlockGeometry) -> torch.Tensor:
    """The block's KV [num_layers, 2, block_size, kv_heads, head_dim] from verified blob bytes."""
    if checksum(data) != expected_checksum:
        raise BadBlob("checksum mismatch (truncated or altered)")
    try:
        tensors = st_load(data)
        metadata = _metadata(data)
    except (SafetensorError, ValueError) as exc:
        raise BadBlob(f"not a readable safetensors file ({exc})") from exc
    kv = tensors.get("kv")
    if metadata.get(_METADATA_KEY) != _label(block_hash):
        raise BadBlob("the blob holds another block")
    if kv is None or tuple(kv.shape) != geometry.block_shape or kv.dtype != geometry.dtype:
        raise BadBlob("the blob's tensor does not fit this model's cache")
    return kv


def _metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {})
