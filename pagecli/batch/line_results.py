"""A batch line's result record, built from its streamed engine events.

A line with n = 1 gets today's record (`text`, `finish_reason`, token counts). A line with n > 1
gets `choices`: one {"index", "text", "finish_reason", "completion_tokens"} per candidate, in index
order, and its record exists only once every candidate has finished, so a record is written whole
and resume counts the line done only then. A beam search line always gets `choices` (its n best beams,
best first: index is the rank), each with its `score`, once all of them are in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Candidate:
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    score: float | None = None  # a beam's sequence score (beam search)


@dataclass
class _Line:
    request_id: str
    num_candidates: int
    candidates: dict[int, _Candidate] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # (text, finish_reason) -> fields a candidate's record gains: the calls of a line with tools (line_tools.py)
    read: Callable[[str, str | None], dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        done = [c for c in self.candidates.values() if c.finish_reason is not None]
        return len(done) == self.num_candidates


class LineResults:
    """Events in, whole records out: `add` returns a line's record when its last candidate finishes."""

    def __init__(self) -> None:
        self._lines: dict[int, _Line] = {}

    def expect(self, line: int, request_id: str, num_candidates: int,
               read: Callable[[str, str | None], dict[str, Any]] | None = None) -> None:
        self._lines[line] = _Line(request_id, num_candidates, read=read)

    def add(self, line: int, event: Any) -> dict[str, Any] | None:
        state = self._lines[line]
        candidate = state.candidates.setdefault(event.index, _Candidate())
        candidate.pieces.append(event.text)
        if not event.finished:
            return None
        candidate.finish_reason = event.finish_reason
        candidate.completion_tokens = event.completion_tokens
        candidate.score = getattr(event, "score", None)
        state.prompt_tokens, state.cached_tokens = event.prompt_tokens, event.cached_tokens
        if not state.finished:
            return None
        del self._lines[line]
        return _record(line, state)


def _record(line: int, state: _Line) -> dict[str, Any]:
    ordered = [state.candidates[i] for i in range(state.num_candidates)]
    if state.num_candidates == 1 and ordered[0].score is None:
        only = ordered[0]
        return {"id": state.request_id, "line": line, "text": "".join(only.pieces),
                "finish_reason": only.finish_reason, "prompt_tokens": state.prompt_tokens,
                "completion_tokens": only.completion_tokens, "cached_tokens": state.cached_tokens,
                **_read(state, only)}
    choices = [{"index": i, "text": "".join(c.pieces), "finish_reason": c.finish_reason,
                "completion_tokens": c.completion_tokens, **_score(c), **_read(state, c)}
               for i, c in enumerate(ordered)]
    return {"id": state.request_id, "line": line, "choices": choices, "prompt_tokens": state.prompt_tokens,
            "completion_tokens": sum(c.completion_tokens for c in ordered), "cached_tokens": state.cached_tokens}


def _score(candidate: _Candidate) -> dict[str, Any]:
    return {} if candidate.score is None else {"score": candidate.score}


def _read(state: _Line, candidate: _Candidate) -> dict[str, Any]:
    return state.read("".join(candidate.pieces), candidate.finish_reason) if state.read else {}
