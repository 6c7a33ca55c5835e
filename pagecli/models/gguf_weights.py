"""The weights a converted GGUF folder leaves in the file: which they are, and their floats on demand.

A Q4_0, Q4_1 or Q8_0 tensor runs as it lies under --quantize gguf (gguf_blocks), so its float32 copy in
the converted folder was 6-8x the file's bytes on disk for nothing (a 3.8 GB 7B Q4_0 file made a 27 GB
folder). The converter writes only the other tensors (norms, F32/F16 weights, and decoder matrices of the
types that do not run as they lie) to the folder's safetensors, and names the rest (gguf_files.held_in_file)
in the folder's record (RECORD_FILE): checkpoint name -> GGUF tensor. A path that needs their floats
(--quantize none/int8/int4, bf16, a GPU, --merge-lora, the transformers comparison) gets them here,
dequantized from the file exactly as the converter would have written them (gguf_convert.hf_tensors_of). A
folder without a record holds every weight itself (one converted before the record existed, or a plain
Hugging Face folder).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pagecli.errors import ModelError
from pagecli.models.gguf_files import CONVERTED_MARKER, HELD_TYPES, RECORD_FILE, RECORD_VERSION, gguf_source
from pagecli.models.gguf_index import INDEX_FILE

_SHARD_INDEX = "model.safetensors.index.json"


def held_names(folder: Path) -> dict[str, str]:
    """Checkpoint name -> GGUF tensor name of the weights `folder` leaves in its GGUF file; {} for a folder
    that holds every weight itself."""
    record = _record(folder)
    return dict(record["tensors"]) if record is not None else {}


def read_weights(folder: Path, names: list[str]) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, float32 numpy array) for these held weights, dequantized from the folder's GGUF
    file; a stacked expert tensor is dequantized once for all the names of it asked for together."""
    from pagecli.models.gguf_convert import hf_tensors_of
    from pagecli.models.gguf_index import map_file, read_tensors, release_pages

    if not names:
        return
    record = _record(folder)
    if record is None:
        raise ModelError(f"'{folder}' keeps no weights in a GGUF file.")
    source = source_file(folder)
    by_tensor: dict[str, set[str]] = {}
    for name in names:
        by_tensor.setdefault(record["tensors"][name], set()).add(name)
    mapping = map_file(source)  # closed when the last view of it goes
    tensors = read_tensors(source, folder, mapping)
    for gguf_name, wanted in by_tensor.items():
        if gguf_name not in tensors:
            raise ModelError(f"GGUF file '{source}' lacks its tensor '{gguf_name}'; pass the .gguf file again.")
        tensor = tensors[gguf_name]
        for name, weight in hf_tensors_of(source, tensor, record["architecture"], record["config"],
                                          _dequantized(source, tensor)):
            if name in wanted:
                yield name, weight
        release_pages(mapping)  # the floats are copies: the file's pages need not stay resident


def _dequantized(gguf_path: Path, tensor: Any) -> Any:
    """gguf_convert.dequantized's floats, the same values bit for bit, sooner: the block types through
    gguf_blocks (a 7B model's Q4_0 table: 1.0 s on one Zen 5 thread), the others (a Q6_K output layer)
    through the gguf package a few rows at a time, in PyTorch's threads (2.7 s on one thread, 7.7 s whole)."""
    import numpy as np
    import torch
    from gguf import dequantize

    from pagecli.models.gguf_convert import dequantized

    hf_shape = tuple(int(dim) for dim in reversed(tensor.shape))
    if tensor.tensor_type.name in HELD_TYPES:
        from pagecli.models.gguf_blocks import dequantize_parts, stacked_parts

        parts = stacked_parts([tensor])  # None: a Q4_0 scale past fp16's range / 8 (the gguf package's path)
        if parts is not None:
            return dequantize_parts(parts).numpy().reshape(hf_shape)
    if tensor.tensor_type.name in ("F32", "F16", "BF16"):
        return dequantized(gguf_path, tensor)
    from concurrent.futures import ThreadPoolExecutor

    rows = int(np.prod(hf_shape[:-1]))
    data = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)  # whole blocks a row
    # ranges of about 4 MB of floats: the package's temporaries stay in cache (one thread: 4x its speed whole)
    step = max(1, (4 << 20) // (4 * hf_shape[-1]))
    starts = range(0, rows, step)
    weight = np.empty((rows, hf_shape[-1]), dtype=np.float32)

    def dequantize_rows(start: int) -> None:
        weight[start:start + step] = dequantize(data[start:start + step], tensor.tensor_type)

    try:
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:  # numpy lets the GIL go in its operations
            list(pool.map(dequantize_rows, starts))
    except NotImplementedError:
        return dequantized(gguf_path, tensor)  # a type the installed gguf cannot dequantize: its one sentence
    return weight.reshape(hf_shape)


def checkpoint(folder: Path) -> dict[str, Any]:
    """Every weight of a converted folder as float32 numpy arrays: its safetensors' and those left in the file."""
    from safetensors.numpy import load_file

    weights: dict[str, Any] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    weights.update(read_weights(folder, list(held_names(folder))))
    return weights


@contextmanager
def full_folder(folder: Path) -> Iterator[Path]:
    """A folder with every weight in its safetensors, for readers that know only checkpoints (transformers):
    `folder` itself where it keeps none in a GGUF file, else a temporary one beside it (write_full_folder),
    removed on exit."""
    if not held_names(folder):
        yield folder
        return
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.full-", dir=folder.parent))
    try:
        write_full_folder(folder, temp)
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def write_full_folder(folder: Path, out: Path, max_shard_bytes: int = 1 << 30) -> None:
    """`folder`'s config, tokenizer and every weight into the existing folder `out`: its own safetensors
    copied, the weights left in the file dequantized (float32) into shards of at most max_shard_bytes (one
    tensor more where one alone is larger: memory stays bounded for a 7B model), all named in
    model.safetensors.index.json."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    for file in folder.iterdir():
        # not the conversion's own files (marker, indexes): the copy is a plain checkpoint folder
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith(".") and \
                file.name not in (RECORD_FILE, INDEX_FILE, _SHARD_INDEX):
            shutil.copy2(file, out / file.name)
    weight_map: dict[str, str] = {}
    for number, file in enumerate(sorted(folder.glob("*.safetensors")), 1):
        name = f"model-kept-{number:05d}.safetensors"
        shutil.copy2(file, out / name)
        with safe_open(str(file), framework="numpy") as kept:
            weight_map.update({key: name for key in kept.keys()})
    shard: dict[str, Any] = {}
    shard_bytes, total_bytes, number = 0, 0, 0

    def save() -> None:
        save_file(shard, str(out / f"model-held-{number:05d}.safetensors"), metadata={"format": "pt"})

    for name, weight in read_weights(folder, list(held_names(folder))):
        if shard and shard_bytes + weight.nbytes > max_shard_bytes:
            save()
            shard, shard_bytes, number = {}, 0, number + 1
        shard[name] = weight
        shard_bytes += weight.nbytes
        total_bytes += weight.nbytes
        weight_map[name] = f"model-held-{number:05d}.safetensors"
    if shard:
        save()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / _SHARD_INDEX).write_text(json.dumps(index, indent=2))


def _record(folder: Path) -> dict[str, Any] | None:
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record["version"] != RECORD_VERSION or not isinstance(record["tensors"], dict):
            raise ValueError(f"record version {record.get('version')}")
        return record
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelError(f"'{path}' is unreadable ({error}); delete '{folder}' and pass the .gguf file again "
                         "(pagecli converts it anew).") from error


def source_file(folder: Path) -> Path:
    """The GGUF file the folder's held weights lie in, checked to be the size it was when converted."""
    source = gguf_source(folder)
    try:
        marker = json.loads((folder / CONVERTED_MARKER).read_text())
    except (OSError, ValueError):
        marker = {}
    if source is None:
        raise ModelError(f"The weights of '{folder}' lie in the GGUF file '{marker.get('source', '?')}', which is "
                         "gone; pass the .gguf file as MODEL (pagecli finds or converts it again).")
    if marker.get("source_bytes") not in (None, source.stat().st_size):
        raise ModelError(f"The GGUF file '{source}' changed since '{folder}' was converted from it; pass the .gguf "
                         "file as MODEL (pagecli converts it anew).")
    return source
