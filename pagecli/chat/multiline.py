'''Multi-line messages typed or piped line by line, as `ollama run` users expect: a line holding
only `"""` opens a block, the next such line closes it, and everything between is one message
with its newlines. A block is always a message, even when it starts with "/".

Both front ends read lines through a BlockReader (the screen, to show a continuation prompt
and let Ctrl-C drop a half-typed block); pasted text with newlines needs no block on a terminal
that supports bracketed paste: it arrives as one line already.
'''

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pagecli.errors import PagecliError

FENCE = '"""'


@dataclass(frozen=True)
class Message:
    """Text to send as it is: a closed block (never read as a slash command)."""

    text: str


Entry = str | Message  # a line to read as a command or a message, or a finished block


class UnclosedBlock(PagecliError):
    """The input ended inside a block."""

    def __init__(self) -> None:
        super().__init__(f'The input ended inside a {FENCE} block; close it with a line holding only {FENCE}. '
                         "Its text was not sent.")


class BlockReader:
    """Turns lines into entries; holds the lines of an open block."""

    def __init__(self) -> None:
        self._block: list[str] | None = None

    @property
    def in_block(self) -> bool:
        return self._block is not None

    def feed(self, line: str) -> Entry | None:
        """The entry this line completes, or None while a block is open (or opens here)."""
        if self._block is None:
            if line.strip() == FENCE:
                self._block = []
                return None
            return line
        if line.strip() == FENCE:
            text, self._block = "\n".join(self._block), None
            return Message(text)
        self._block.append(line)
        return None

    def drop_block(self) -> bool:
        """Forget an open block (Ctrl-C while typing one); whether there was one."""
        had_block, self._block = self._block is not None, None
        return had_block


def read_entries(lines: Iterable[str]) -> Iterator[Entry]:
    """Entries from lines (line endings already gone); UnclosedBlock when the lines end inside a block."""
    reader = BlockReader()
    for line in lines:
        entry = reader.feed(line)
        if entry is not None:
            yield entry
    if reader.in_block:
        raise UnclosedBlock()
