"""What a GGUF file's decoder weights are, without torch: the file a converted folder came from, how many
matrices each GGUF type holds, which of them `--quantize gguf` runs as they lie, and which stay in the file
rather than in the converted folder (held_in_file, named in the folder's record: gguf_weights reads it).
`pagecli models` reads this; gguf_blocks.py turns the blocks into tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AS_IS_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # read as they are; Q4_* run in 4 bits, Q8_0 requantized to int8
CONVERTED_MARKER = ".pagecli-converted.json"  # a converted folder's: the file it came from (source.py writes it)
RECORD_FILE = "gguf-weights.json"  # a converted folder's: the weights it leaves in the file
RECORD_VERSION = 1
HELD_TYPES = AS_IS_TYPES  # the types left in the file: those gguf_blocks runs as they lie
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# The converter's config fields that turning a GGUF tensor into its checkpoint weights reads (gguf_convert).
_RECORD_CONFIG_KEYS = ("model_type", "num_attention_heads", "num_key_value_heads", "num_experts",
                       "num_local_experts")
# GGML's type ids (ggml.h, gguf.GGMLQuantizationType) of the types most files hold; a test keeps them equal.
_COMMON_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
                      11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


def gguf_source(folder: Path) -> Path | None:
    """The .gguf file a converted folder came from (its conversion marker says), if it is still there."""
    try:
        source = Path(json.loads((folder / CONVERTED_MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


def held_in_file(tensor: Any) -> bool:
    """Whether a GGUF tensor stays in the file rather than in the converted folder: the block types that
    gguf_blocks runs as they lie, and the quantized tables outside the decoder layers whatever their type
    (llama.cpp's Q4_0 files keep the output layer in Q6_K: its float32 copy alone was 14% of a 7B file).
    Decoder matrices of the other quantized types (K-quants) keep their float32 copy: the gguf package
    dequantizes them at 18-45 M weights a second, minutes a start for a whole 7B model."""
    kind = tensor.tensor_type.name
    return kind in HELD_TYPES or (quantized_type(kind) and not tensor.name.startswith("blk."))


def write_record(folder: Path, held: dict[str, str], architecture: str, config: dict[str, Any]) -> None:
    """The record of the weights left in the file (checkpoint name -> GGUF tensor name) into `folder`,
    where any are; the GGUF architecture and the config fields their conversion needs go with them."""
    if not held:
        return
    record = {"version": RECORD_VERSION, "architecture": architecture,
              "config": {key: config[key] for key in _RECORD_CONFIG_KEYS if key in config}, "tensors": held}
    (folder / RECORD_FILE).write_text(json.dumps(record))


def tensor_types(gguf_path: Path, folder: Path | None = None) -> dict[str, int]:
    """How many of the file's decoder-layer matrices each GGUF type holds, a stacked expert tensor counting one
    per expert (through the converted folder's index, gguf_index, where one is given)."""
    from pagecli.models.gguf_index import tensor_entries

    counts: dict[str, int] = {}
    for name, (kind, _offset, _size, *shape) in tensor_entries(gguf_path, folder).items():
        if name.startswith("blk.") and len(shape) in (2, 3):
            type_name = type_name_of(kind)
            counts[type_name] = counts.get(type_name, 0) + (shape[2] if len(shape) == 3 else 1)
    return counts


def output_type(gguf_path: Path, folder: Path | None = None) -> str | None:
    """The GGUF type of the file's own output layer (output.weight), None where it has none (a tied table)."""
    from pagecli.models.gguf_index import tensor_entries

    entry = tensor_entries(gguf_path, folder).get("output.weight")
    return None if entry is None else type_name_of(entry[0])


def quantized_type(type_name: str) -> bool:
    """Whether a GGUF type is a quantized one (its maker chose to round those weights), not a float type."""
    return type_name not in _FLOAT_TYPES


def type_name_of(kind: int) -> str:
    """GGML's name for a tensor type id (gguf.GGMLQuantizationType's), the common ones without importing
    gguf and numpy (0.2 s of `pagecli models`)."""
    name = _COMMON_TYPE_NAMES.get(kind)
    if name is None:
        from gguf import GGMLQuantizationType

        name = GGMLQuantizationType(kind).name
    return name


def describe_path(gguf_path: Path, folder: Path | None = None) -> str:
    """One line: which of the file's decoder weights run as they are with --quantize gguf, which as floats
    (folder: its converted folder, whose index saves parsing the file)."""
    counts = tensor_types(gguf_path, folder)
    as_is = {t: n for t, n in counts.items() if t in AS_IS_TYPES}
    floats = {t: n for t, n in counts.items() if t not in AS_IS_TYPES}
    parts = []
    if as_is:
        kinds = ", ".join(f"{t} x{n}" for t, n in sorted(as_is.items()))
        requantized = (" (Q8_0 as it is on the AVX2 int8 kernel: float32 models, CPUs without VNNI; else "
                       "requantized to pagecli's int8 blocks of 64)" if "Q8_0" in as_is else "")
        parts.append(f"--quantize gguf runs {kinds} as they are{requantized}")
    if floats:
        parts.append("dequantized to float: " + ", ".join(f"{t} x{n}" for t, n in sorted(floats.items())))
    return "; ".join(parts) or "no decoder matrices"
