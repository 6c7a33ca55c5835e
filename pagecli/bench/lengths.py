"""Request lengths for `bench memory`, from what a user types: a list, a file, or a seeded distribution.

  800,2300,3900            the lengths themselves
  lengths.txt              a file of integers (separated by commas, spaces or newlines; '#' comments)
  uniform:20-4000          COUNT lengths drawn uniformly from 20..4000 (inclusive)
  normal:1500,400          COUNT lengths from a normal distribution (mean, standard deviation)
  lognormal:800,1.0        COUNT lengths from a log-normal (median, sigma): many short, a long tail

Drawn lengths are rounded and clipped to 1..max_len; the same seed gives the same lengths.
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
_USAGE = "write 800,2300,3900, a file of lengths, or uniform:20-4000, normal:1500,400 or lognormal:800,1.0"


def parse_lengths(spec: str, count: int, seed: int, max_len: int) -> tuple[int, ...]:
    spec = spec.strip()
    kind, _, params = spec.partition(":")
    if params and kind in _DISTRIBUTIONS:
        return draw_lengths(kind, params, count, seed, max_len)
    if Path(spec).is_file():
        return _lengths_from_file(Path(spec))
    return _integers(spec, f"--lengths '{spec}'")


def draw_lengths(kind: str, params: str, count: int, seed: int, max_len: int) -> tuple[int, ...]:
    match = _DISTRIBUTIONS[kind].fullmatch(params.replace(" ", ""))
    if match is None:
        raise PagecliError(f"Cannot read the distribution '{kind}:{params}'; {_USAGE}.")
    if count < 1:
        raise PagecliError(f"--count must be at least 1 (got {count}).")
    a, b = float(match.group(1)), float(match.group(2))
    rng = random.Random(seed)
    if kind == "uniform":
        if a > b:
            raise PagecliError(f"uniform:{params} has its bounds the wrong way round.")
        draws = [rng.randint(int(a), int(b)) for _ in range(count)]
    elif kind == "normal":
        draws = [round(rng.gauss(a, b)) for _ in range(count)]
    else:
        if a <= 0:
            raise PagecliError(f"lognormal:{params} needs a positive median.")
        draws = [round(rng.lognormvariate(math.log(a), b)) for _ in range(count)]
    return tuple(min(max(n, 1), max_len) for n in draws)


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
