"""Reading an input file's lines with bounded memory: the encoding from its byte order mark, lines split at
`\\n` only, and a limit on each line's length applied while reading (a line past it ends the read at once,
before the rest of it is read).

Encodings: UTF-8 (with or without a BOM); UTF-16 and UTF-32 (LE or BE) when the file starts with their BOM,
transcoded chunk by chunk. Bytes that do not decode become U+FFFD. Without a BOM, a file full of NUL bytes
every other byte (UTF-16 without its mark) is refused by name rather than read as NUL-riddled prompts.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from pagecli.errors import PagecliError

DEFAULT_MAX_LINE_BYTES = 4 << 20  # 4 MiB: far above any prompt a model's context takes
CHUNK_BYTES = 1 << 20
_BOMS = (  # longest first: UTF-32 LE's mark begins with UTF-16 LE's
    (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
)


class LineTooLong(PagecliError):
    """A line of the input is longer than the limit."""


def line_too_long(name: str, line: int, max_line_bytes: int) -> LineTooLong:
    return LineTooLong(f"Line {line} of {name} is longer than {max_line_bytes:,} bytes (--max-line-bytes); "
                       "nothing was run. Split the line, or raise --max-line-bytes.")


def read_lines(stream: BinaryIO, name: str, max_line_bytes: int) -> list[str]:
    """Every line of `stream` (its last line break ends a line, it does not start one), a `\\r` before the
    `\\n` dropped; LineTooLong as soon as a line passes `max_line_bytes` (counted in UTF-8)."""
    return [_text(line) for line in split_chunks(_utf8_chunks(stream, name), name, max_line_bytes)]


def split_chunks(chunks: Iterable[bytes], name: str, max_line_bytes: int) -> Iterator[bytes]:
    """The lines of a stream of UTF-8 chunks, each without its `\\n`; never holds more than one line."""
    pending = bytearray()
    number = 1
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if len(pending) + len(piece) > max_line_bytes:
                raise line_too_long(name, number, max_line_bytes)
            pending += piece
            if end < 0:
                break
            yield bytes(pending)
            pending.clear()
            number += 1
            start = end + 1
    if pending:
        yield bytes(pending)


def _text(line: bytes) -> str:
    text = line.decode("utf-8", errors="replace")
    return text[:-1] if text.endswith("\r") else text


def _utf8_chunks(stream: BinaryIO, name: str) -> Iterator[bytes]:
    """The stream's bytes as UTF-8, its BOM dropped; UTF-16/32 (by their BOM) transcoded as they come."""
    head = _read_at_least(stream, 4)
    encoding, skip = next(((enc, len(bom)) for bom, enc in _BOMS if head.startswith(bom)), ("utf-8", 0))
    if encoding == "utf-8":
        _refuse_utf16_without_bom(head, name)
        yield head[skip:]
        yield from iter(lambda: stream.read(CHUNK_BYTES), b"")
        return
    decoder = codecs.getincrementaldecoder(encoding)(errors="replace")
    for chunk in (head[skip:], *iter(lambda: stream.read(CHUNK_BYTES), b"")):
        yield decoder.decode(chunk).encode("utf-8", errors="replace")
    yield decoder.decode(b"", final=True).encode("utf-8", errors="replace")


def _read_at_least(stream: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes (fewer only at the end): a pipe may hand them over one at a time."""
    data = b""
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _refuse_utf16_without_bom(head: bytes, name: str) -> None:
    """Text in UTF-16 without its mark starts with a NUL in every other byte (ASCII text); say so by name."""
    if len(head) < 4:
        return
    little, big = head[1] == head[3] == 0 and head[0] and head[2], head[0] == head[2] == 0 and head[1] and head[3]
    if little or big:
        raise PagecliError(f"{name[0].upper() + name[1:]} looks like UTF-16 text without a byte order mark; "
                           "pagecli reads UTF-8, or UTF-16/UTF-32 that starts with its BOM. Convert it to "
                           "UTF-8 (iconv -f UTF-16LE -t UTF-8).")
