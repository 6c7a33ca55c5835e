"""Byte sizes as people type them (8GiB, 500MB, 1.5G) and as people read them (7.45 GiB).

One parser for every size option in pagecli (the bench budget, the disk store's cap):
binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T of `ls -h` and `df -h`) are powers
of 1024; SI units (kB, MB, GB, TB) are powers of 1000; a bare number is bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

from pagecli.errors import PagecliError

_MULTIPLIERS = {
    "": 1, "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
MAX_SIZE_BYTES = 1 << 60  # an exbibyte: a larger size is a typo, and would not even print as a float


def parse_size(text: str) -> int:
    """Bytes in a size string: '8GiB' -> 8589934592, '500MB' -> 500000000, '4096' -> 4096."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MULTIPLIERS:
        raise PagecliError(f"Cannot read the size '{text}'; write it like 8GiB, 512MiB, 500MB or 1048576 (bytes).")
    num_bytes = int(Fraction(match.group(1)) * _MULTIPLIERS[unit])  # exact: a float of 400 digits is inf
    if num_bytes > MAX_SIZE_BYTES:
        raise PagecliError(f"The size '{text.strip()}' is more than 1 EiB; no memory or disk is that large.")
    return num_bytes


def format_bytes(num_bytes: float) -> str:
    """A byte count in binary units, about three significant figures: '7.45 GiB', '720 KiB', '12 B'."""
    value = float(num_bytes)
    unit = _BINARY_UNITS[0]
    for unit in _BINARY_UNITS:
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            break
        value /= 1024
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}" if abs(value) >= 10 else f"{value:.2f} {unit}"
