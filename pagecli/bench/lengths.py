"""Request lengths for `bench memory`, from what a user types: a list, a file, or a seeded distribution.

  800,2300,3900            the lengths themselves
  lengths.txt              a file of integers (separated by commas, spaces or newlines; '#' comments)
  uniform:20-4000          COUNT lengths drawn uniformly from 20..4000 (inclusive)
  normal:1500,400          COUNT lengths from a normal distribution (mean, standard deviation)
  lognormal:800,1.0        COUNT lengths from a log-normal (median, sigma): many short, a long tail

A distribution's minimum, mean or median must be at least 1 token; drawn lengths are rounded and
clipped to 1..max_len; the same seed gives the same lengths. COUNT is at most MAX_COUNT.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

from pagecli.errors import PagecliError

_NUMBER = r"(\d+(?:\.\d*)?)"
_DISTRIBUTIONS = {
    "uniform": re.compile(rf"{_NUMBER}-{_NUMBER}"),
    "normal": re.compile(rf"{_NUMBER},{_NUMBER}"),
    "lognormal": re.compile(rf"{_NUMBER},{_NUMBER}"),
}
_FIRST_PARAMETER = {"uniform": "lower bound", "normal": "mean", "lognormal": "median"}
MAX_COUNT = 1_000_000
_USAGE = "write 800,2300,3900, a file of lengths, or uniform:20-4000, normal:1500,400 or lognormal:800,1.0"


def parse_lengths(spec: str, count: int, seed: int, max_len: int) -> tuple[int, ...]:
    spec = spec.strip()
    kind, _, params = spec.partition(":")
    if params and kind in _DISTRIBUTIONS:
        return draw_lengths(kind, params, count, seed, max_len)
    if _is_file(spec):
        return _lengths_from_file(Path(spec))
    return _integers(spec, f"--lengths '{spec}'")


def _is_file(spec: str) -> bool:
    try:
        return Path(spec).is_file()
    except OSError:  # a list of lengths too long to be a file name
        return False


def draw_lengths(kind: str, params: str, count: int, seed: int, max_len: int) -> tuple[int, ...]:
    spec = f"{kind}:{params}"
    match = _DISTRIBUTIONS[kind].fullmatch(params.replace(" ", ""))
    if match is None:
        raise PagecliError(f"Cannot read the distribution '{spec}'; {_USAGE}.")
    if max_len < 1:
        raise PagecliError(f"--max-len must be at least 1 (got {max_len}).")
    if not 1 <= count <= MAX_COUNT:
        raise PagecliError(f"--count must be between 1 and {MAX_COUNT:,} (got {count}).")
    a, b = float(match.group(1)), float(match.group(2))
    if not (math.isfinite(a) and math.isfinite(b)):
        raise PagecliError(f"The distribution '{spec}' has a number too large to use; {_USAGE}.")
    if a < 1:
        raise PagecliError(f"The distribution '{spec}' has a {_FIRST_PARAMETER[kind]} of {a:g} tokens; "
                           "request lengths must be at least 1.")
    rng = random.Random(seed)
    if kind == "uniform":
        if a > b:
            raise PagecliError(f"The distribution '{spec}' has its bounds the wrong way round.")
        return tuple(min(rng.randint(int(a), int(b)), max_len) for _ in range(count))
    if kind == "normal":
        return tuple(_clipped(rng.gauss(a, b), max_len) for _ in range(count))
    # log-normal, drawn in log space: exp of a long tail's draw can exceed any float
    log_max_len = math.log(max_len)
    draws = (rng.normalvariate(math.log(a), b) for _ in range(count))
    return tuple(max_len if x >= log_max_len else _clipped(math.exp(x), max_len) for x in draws)


def _clipped(length: float, max_len: int) -> int:
    """A drawn length rounded and clipped to 1..max_len (an infinite draw is max_len)."""
    if length >= max_len:
        return max_len
    return round(length) if length >= 1 else 1


def _lengths_from_file(path: Path) -> tuple[int, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PagecliError(f"Cannot read the lengths file '{path}': {exc}.") from None
    body = " ".join(line.split("#", 1)[0] for line in text.splitlines())
    return _integers(body, f"the lengths file '{path}'")


def _integers(text: str, where: str) -> tuple[int, ...]:
    items = [item for item in re.split(r"[,\s]+", text) if item]
    if not items:
        raise PagecliError(f"No request lengths in {where}; {_USAGE}.")
    try:
        return tuple(int(item) for item in items)
    except ValueError:
        bad = next(item for item in items if not item.lstrip("-").isdigit())
        raise PagecliError(f"'{bad}' in {where} is not a whole number of tokens; {_USAGE}.") from None
