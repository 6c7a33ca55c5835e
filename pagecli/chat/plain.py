"""The plain chat view for pipes and scripts: replies as text on stdout, or one JSON record per turn.

No colours, no live panel. Notices go to stderr so stdout holds only replies (text mode) or
records (JSONL mode: turns, errors and /stats, each one line).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from pagecli.chat.view import LiveStatus, TurnRecord
from pagecli.chat.conversation import Conversation
from pagecli.chat.multiline import Entry, read_entries
from pagecli.chat.turn import TurnStats
from pagecli.engine.stats import EngineStats
from pagecli.errors import PagecliError


def turn_record(record: TurnRecord) -> dict[str, Any]:
    """The JSONL record of a turn: the texts, the turn's figures and the engine snapshot after it."""
    result = record.result
    return {
        "turn": record.number, "user": record.user, "reply": result.text, "finish_reason": result.finish_reason,
        **result.stats.to_dict(), "dropped_turns": record.dropped_turns, "stats": result.engine_stats.to_dict(),
    }


def input_entries(stream: Iterable[str], max_line_bytes: int | None = None) -> Iterator[Entry]:
    """One user message per line, or per block between two lines of three double quotes; blank lines
    outside blocks are skipped. UnclosedBlock (a PagecliError) when the input ends inside a block; with
    `max_line_bytes`, a PagecliError as soon as a line passes it (a file stream is read no further)."""
    lines = stream if max_line_bytes is None else bounded_lines(stream, max_line_bytes)
    for entry in read_entries(line.rstrip("\r\n") for line in lines):
        if not isinstance(entry, str) or entry.strip():
            yield entry


def bounded_lines(stream: Iterable[str], max_line_bytes: int) -> Iterator[str]:
    """The lines of a text stream, each read with a limit (`readline(size)`), so a line without an end
    (/dev/zero) costs at most `max_line_bytes` characters before it is refused."""
    readline = getattr(stream, "readline", None)
    if readline is None:
        yield from stream  # a list of lines: already in memory
        return
    number = 0
    while line := readline(max_line_bytes + 1):
        number += 1
        if len(line.rstrip("\r\n").encode("utf-8", "surrogateescape")) > max_line_bytes:
            raise PagecliError(f"Input line {number} is longer than {max_line_bytes:,} bytes (--max-line-bytes); "
                               "split it, or raise --max-line-bytes.")
        yield line


class PlainView:
    def __init__(self, out: TextIO, err: TextIO, jsonl: bool = False) -> None:
        self.out = out
        self.err = err
        self.jsonl = jsonl

    def _record(self, data: dict[str, Any]) -> None:
        self.out.write(json.dumps(data, ensure_ascii=False) + "\n")
        self.out.flush()

    def _err_line(self, message: str) -> None:
        self.err.write(message + "\n")
        self.err.flush()

    def notice(self, message: str) -> None:
        self._err_line(message)

    def problem(self, message: str) -> None:
        if self.jsonl:
            self._record({"error": message})
        else:
            self._err_line(f"Error: {message}")

    def begin_reply(self, live_status: LiveStatus) -> None:
        pass

    def reply_text(self, delta: str) -> None:
        if not self.jsonl:
            self.out.write(delta)
            self.out.flush()

    def refresh(self) -> None:
        pass

    def end_reply(self, record: TurnRecord | None) -> None:
        if self.jsonl:
            if record is not None:
                self._record(turn_record(record))
            return
        if record is not None:
            self.out.write("\n")
            self.out.flush()
            if record.result.finish_reason == "abort":
                self._err_line("[stopped]")

    def show_help(self, rows: list[tuple[str, str]]) -> None:
        for usage, what in rows:
            self._err_line(f"{usage:24} {what}")

    def show_stats(self, stats: EngineStats) -> None:
        if self.jsonl:
            self._record({"stats": stats.to_dict()})
            return
        for key, value in stats.to_dict().items():
            self._err_line(f"{key}: {value}")

    def toggle_pool(self, stats: EngineStats, turn: TurnStats | None) -> None:
        self.notice("The pool panel shows only on a terminal; /stats prints the same figures.")

    def show_transcript(self, conversation: Conversation) -> None:
        pass
