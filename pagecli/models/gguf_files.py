"""What a GGUF file's decoder weights are, without torch: the file a converted folder came from, how many
matrices each GGUF type holds, and which of them `--quantize gguf` runs as they lie. `pagecli models`
reads this; gguf_blocks.py turns the blocks into tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

AS_IS_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # read as they are; Q4_* run in 4 bits, Q8_0 requantized to int8


def gguf_source(folder: Path) -> Path | None:
    """The .gguf file a converted folder came from (its conversion marker says), if it is still there."""
    from pagecli.models.source import CONVERTED_MARKER

    try:
        source = Path(json.loads((folder / CONVERTED_MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.is_file() else None


def tensor_types(gguf_path: Path, folder: Path | None = None) -> dict[str, int]:
    """How many of the file's decoder-layer matrices each GGUF type holds (through the converted
    folder's index, gguf_index, where one is given)."""
    from pagecli.models.gguf_index import read_tensors

    counts: dict[str, int] = {}
    for tensor in read_tensors(gguf_path, folder).values():
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


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
