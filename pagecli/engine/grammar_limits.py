"""What a grammar may ask of the compiler, and what it may say back: limits checked before xgrammar compiles a
request's constraint, its warnings turned into refusals, and a deadline on the compile itself.

xgrammar's compile time grows with repetition (a `maxLength` of 10**6 took 2.5 s with SmolLM2's vocabulary, a
regex `{1,20000}` 0.6 s, 300 properties with `[a-z]{n}` patterns 10 s) and with the text of the constraint
(an enum of 20,000 values: 1.5 s), so those are bounded before it starts. The compile then runs on a thread of
its own (xgrammar releases the GIL) and its request is refused once it passes the deadline; a thread cannot
be stopped, so the bounds above are what keeps such a straggler short. xgrammar writes a warning to the
process's stderr when it drops a rule (`pattern` with `minLength`, a lookahead, an anchor in the middle of a
regex); while it compiles, fd 2 is captured, and any such warning refuses the request in a sentence.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pagecli.errors import RequestError

T = TypeVar("T")

MAX_CONSTRAINT_CHARS = 256 << 10  # the schema, regex or grammar text
MAX_REPEAT = 100_000  # any one minLength/maxLength/minItems/maxItems/minProperties/maxProperties
MAX_REGEX_REPEAT_TOTAL = 10_000  # the `{m,n}` bounds of every regex in the constraint, added up
COMPILE_TIME_S = 5.0
MAX_COMPILED_BYTES = 128 << 20  # the compiled grammar's token-mask cache

_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_QUANTIFIER = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_NATIVE_WARNING = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: Warning: (.*)$")
_capture_lock = threading.Lock()


def refuse_oversized(kind: str, text: str, regexes: list[str]) -> None:
    """RequestError when the constraint's text or the repetition its regexes ask for is past the limits."""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise RequestError(f"the {kind} constraint is {len(text):,} characters long; at most "
                           f"{MAX_CONSTRAINT_CHARS:,} can be compiled")
    total = 0
    for regex in regexes:
        for low, high in _QUANTIFIER.findall(regex):
            total += max(int(low), int(high) if high else 0)
    if total > MAX_REGEX_REPEAT_TOTAL:
        raise RequestError(f"the {kind} constraint's regular expressions repeat {total:,} times in all (their "
                           f"{{m,n}} bounds added up); at most {MAX_REGEX_REPEAT_TOTAL:,} can be compiled")


def refuse_large_count(schema: dict[str, Any], where: str) -> None:
    """A length or count keyword of one schema node past MAX_REPEAT (each is a repetition the compiler unrolls)."""
    for key in _COUNT_KEYWORDS:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
            raise RequestError(f"the JSON schema's '{key}' at {where} is {value:,}; at most {MAX_REPEAT:,} can be "
                               "compiled into a constraint")


def regex_problem(regex: str) -> str | None:
    """What xgrammar would drop from a regex without enforcing it (a lookaround, an anchor in the middle)."""
    in_class, i = False, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if regex[i + 1:i + 2] == "]":
                i += 1  # a ']' first in a class is a literal
        elif regex.startswith(("(?=", "(?!"), i):
            return "a lookahead"
        elif regex.startswith(("(?<=", "(?<!"), i):
            return "a lookbehind"
        elif char == "^" and i != 0:
            return "'^' in the middle"
        elif char == "$" and i != len(regex) - 1:
            return "'$' in the middle"
        i += 1
    return None


def compile_bounded(kind: str, compile_fn: Callable[[], T]) -> T:
    """compile_fn() on a thread of its own, its stderr captured: RequestError past COMPILE_TIME_S, for a rule
    xgrammar says it drops, or for a compiled grammar larger than MAX_COMPILED_BYTES."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = compile_fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            outcome["error"] = exc

    with _native_warnings() as warnings:
        worker = threading.Thread(target=run, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(COMPILE_TIME_S)
    if worker.is_alive():
        raise RequestError(f"the {kind} constraint took longer than {COMPILE_TIME_S:g} s to compile; simplify it")
    if "error" in outcome:
        raise outcome["error"]
    if warnings:
        raise RequestError(f"the {kind} constraint has a rule the grammar engine cannot enforce and would drop "
                           f"({_sentence_of(warnings[0])}); remove it or check it after generation")
    compiled = outcome["value"]
    size = getattr(compiled, "memory_size_bytes", 0)
    if isinstance(size, int) and size > MAX_COMPILED_BYTES:
        raise RequestError(f"the {kind} constraint compiles to {size >> 20:,} MiB of token masks; at most "
                           f"{MAX_COMPILED_BYTES >> 20} MiB: simplify it")
    return compiled


def _sentence_of(warning: str) -> str:
    return warning.rstrip(". ")


@contextmanager
def _native_warnings() -> Iterator[list[str]]:
    """fd 2 redirected into a temporary file while the block runs; yields the list that then holds xgrammar's
    warnings. Whatever else was written there meanwhile (another thread's log line) goes on to the real stderr."""
    found: list[str] = []
    with _capture_lock, tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield found
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            others = []
            for line in capture.read().decode("utf-8", errors="replace").splitlines():
                match = _NATIVE_WARNING.match(line)
                if match:
                    found.append(match.group(1))
                else:
                    others.append(line)
            if others:
                sys.stderr.write("\n".join(others) + "\n")
