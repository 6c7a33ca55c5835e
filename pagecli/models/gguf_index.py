"""Where a GGUF file's tensors lie (name -> type, shape, byte offset), kept beside its converted folder.

gguf's GGUFReader parses every metadata field when it opens a file: for the embedded model (a 49,152
token vocabulary and its merges) that takes about 4 s, and running a converted model on its file's
own blocks (--quantize gguf, the default for float32 runs) needs the file's tensors twice at start.
The index is written when the file is converted (which reads it anyway) and read back in
milliseconds; the tensors' bytes are then views of one read-only memory map of the file. A folder
converted before the index existed gets it the first time it is needed.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagecli.errors import ModelError

if TYPE_CHECKING:
    import numpy as np

INDEX_FILE = "gguf-tensors.json"
_INDEX_VERSION = 1


@dataclass(frozen=True)
class IndexedTensor:
    """What gguf_blocks reads of a tensor, as GGUFReader's ReaderTensor gives it: its type, its shape in
    GGUF order (innermost first) and its bytes (uint8, flat)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def index_entries(reader: Any) -> dict[str, list[int]]:
    """name -> [type, byte offset in the file, bytes, *shape] for every tensor a GGUFReader found."""
    return {tensor.name: [int(tensor.tensor_type), int(tensor.data_offset), int(tensor.n_bytes),
                          *(int(d) for d in tensor.shape)] for tensor in reader.tensors}


def write_index(entries: dict[str, list[int]], gguf_path: Path, folder: Path) -> None:
    """The index (index_entries) of `gguf_path` into `folder` (written whole, then renamed into place)."""
    index = {"version": _INDEX_VERSION, "source_bytes": gguf_path.stat().st_size, "tensors": entries}
    temp = folder / f".{INDEX_FILE}.tmp-{os.getpid()}"
    temp.write_text(json.dumps(index))
    os.replace(temp, folder / INDEX_FILE)


def tensor_entries(gguf_path: Path, folder: Path | None = None) -> dict[str, list[int]]:
    """The file's index (index_entries): `folder`'s where it holds one for this file (plain JSON: neither
    numpy nor gguf imported), else parsed by GGUFReader and written there for next time, where the folder
    is writable."""
    entries = _stored_entries(gguf_path, folder) if folder is not None else None
    if entries is None:

        entries = index_entries(open_reader(gguf_path))
        if folder is not None:
            try:
                write_index(entries, gguf_path, folder)
            except OSError:
                pass  # a read-only cache: the next start parses the file again
    return entries


def map_file(gguf_path: Path) -> mmap.mmap:
    """A read-only memory map of the whole file. Its pages count as the process's memory once read, until
    `release_pages` gives them back (they stay in the page cache: a later read is no disk read)."""
    with open(gguf_path, "rb") as file:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def release_pages(mapping: mmap.mmap) -> None:
    """Drop the map's pages from this process's resident memory (read again from the page cache if a
    tensor viewing them is read later): a file read once, a layer at a time, never counts whole."""
    if hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def read_tensors(gguf_path: Path, folder: Path | None = None,
                 mapping: mmap.mmap | None = None) -> dict[str, IndexedTensor]:
    """The file's tensors by name, their bytes views of one read-only memory map (tensor_entries): `mapping`
    (map_file's) where given."""
    import numpy as np
    from gguf import GGMLQuantizationType

    entries = tensor_entries(gguf_path, folder)
    mapping = np.frombuffer(mapping if mapping is not None else map_file(gguf_path), dtype=np.uint8)
    tensors = {}
    for name, (kind, offset, size, *shape) in entries.items():
        if offset < 0 or size < 0 or offset + size > mapping.size:
            raise ModelError(f"GGUF file '{gguf_path}' is shorter than its tensor '{name}' needs; is it truncated?")
        tensors[name] = IndexedTensor(name, GGMLQuantizationType(kind), tuple(shape), mapping[offset:offset + size])
    return tensors


def _stored_entries(gguf_path: Path, folder: Path) -> dict[str, list[int]] | None:
    """The folder's index if it is there, readable, and made from a file of this size."""
    try:
        index = json.loads((folder / INDEX_FILE).read_text())
        if index["version"] != _INDEX_VERSION or index["source_bytes"] != gguf_path.stat().st_size:
            return None
        entries = index["tensors"]
        if not all(isinstance(v, list) and len(v) >= 4 and all(isinstance(n, int) for n in v) for v in entries.values()):
            return None
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def open_reader(gguf_path: Path) -> Any:
    """The gguf package's reader over a file (its tensors memory-mapped); ModelError if it is not one."""
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise ModelError(f"'{gguf_path}' is not a readable GGUF file ({error}).") from error
