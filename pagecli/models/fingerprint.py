"""Model fingerprint: what a cached KV block depends on, as one stable digest.

It covers the weights (each safetensors file's header, which names every tensor with its
dtype, shape and byte offsets, plus the file size and a digest of sampled bytes of the
data; for a converted GGUF folder, its record of the weights left in the GGUF file, the file's size and
sampled bytes of it), the tokenizer files, the chat template, the KV dtype, the block size and the cache
layout version. Prefix-cache hash chains are rooted in it, so KV computed by any other
model or setting can never be found.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from pagecli.models.gguf_files import RECORD_FILE

if TYPE_CHECKING:
    import torch

    from pagecli.kv_format import KVFormat

CACHE_LAYOUT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")
_SAMPLE_BYTES = 1 << 16  # bytes of tensor data read at each of a few offsets per file


def weights_digest(folder: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as f:
            header_len_bytes = f.read(8)
            header_len = struct.unpack("<Q", header_len_bytes)[0] if len(header_len_bytes) == 8 else 0
            h.update(file.name.encode() + size.to_bytes(8, "little") + f.read(min(header_len, size)))
            _sample(h, f, size, (0.25, 0.5, 0.75, 1.0))  # a retrained model with the same shapes differs
    _gguf_file(h, folder)
    return h.hexdigest()


def _sample(h: Any, f: BinaryIO, size: int, fractions: tuple[float, ...]) -> None:
    """_SAMPLE_BYTES of the open file ending at each fraction of its size (from its start at 0) into h."""
    for fraction in fractions:
        f.seek(max(0, int(size * fraction) - (_SAMPLE_BYTES if fraction else 0)))
        h.update(f.read(_SAMPLE_BYTES))


def _gguf_file(h: Any, folder: Path) -> None:
    """The weights a converted GGUF folder leaves in its file (gguf_weights), which no safetensors holds: the
    folder's record of them, the file's size and sampled bytes of it (the first and a few spread over the
    tensors: another file of the same shapes differs). Nothing for a folder that holds every weight."""
    record = folder / RECORD_FILE
    if not record.is_file():
        return
    from pagecli.models.gguf_weights import source_file

    source = source_file(folder)
    size = source.stat().st_size
    h.update(hashlib.blake2b(record.read_bytes(), digest_size=16).digest() + size.to_bytes(8, "little"))
    with source.open("rb") as f:
        _sample(h, f, size, (0.0, 0.2, 0.4, 0.6, 0.8, 1.0))


def tokenizer_digest(folder: Path, chat_template: str | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(name.encode() + path.read_bytes())
    h.update((chat_template or "").encode())
    return h.hexdigest()


def model_fingerprint(folder: Path, chat_template: str | None, kv_dtype: str, block_size: int) -> str:
    return "|".join((
        f"layout={CACHE_LAYOUT_VERSION}",
        f"weights={weights_digest(folder)}",
        f"tokenizer={tokenizer_digest(folder, chat_template)}",
        f"kv_dtype={kv_dtype}",
        f"block_size={block_size}",
    ))


def kv_fingerprint_name(model_dtype: torch.dtype, quantize: str, kv_format: KVFormat, wide: bool = False) -> str:
    """What the disk store's fingerprint says of the KV bytes: the model dtype they come from (and its
    weight quantization), and the cache format when it is not the model's dtype. Runs with
    `--kv-dtype auto` keep the name they had before the option existed, so their stores still hit.
    wide: the 4-bit products round activations to int16 on the VNNI panels (WeightPlan.rounds_wide), which
    stores made before that kernel, or at the avx2 level, did not."""
    from pagecli.models.quantize import INT8_FORMAT, WIDE_LEVELS

    weights = {"none": "", "int8": f"+{INT8_FORMAT}"}.get(quantize, f"+{quantize}")
    if wide:
        weights += f"/a{WIDE_LEVELS}"
    name = str(model_dtype).removeprefix("torch.") + weights
    if kv_format.name != str(model_dtype).removeprefix("torch."):
        name += f"/kv-{kv_format.name}"
    return name
