"""One chat turn on the engine: send the prompt ids, stream the reply, stop on request, and
measure the turn from two EngineStats snapshots (the same snapshot bench and JSON read).

The chat engine runs one request at a time, so the difference between the snapshot taken
before the turn and one taken now is exactly this turn's prefix hits and prefill work.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from pagecli.config.settings import SamplingParams
from pagecli.engine.stats import EngineStats


@dataclass(frozen=True)
class TurnStats:
    """The figures of one turn: where its prompt tokens came from, and how fast the reply came."""

    prompt_tokens: int
    cached_tokens: int  # served from the in-memory prefix cache (tier 1)
    cached_disk_tokens: int  # served from the disk prefix store (tier 2)
    prefilled_tokens: int  # prompt tokens actually computed
    completion_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None

    @classmethod
    def between(cls, before: EngineStats, now: EngineStats, prompt_tokens: int, completion_tokens: int,
                ttft_s: float | None, decode_tokens_per_s: float | None) -> TurnStats:
        return cls(
            prompt_tokens=prompt_tokens,
            cached_tokens=now.prefix_hit_tokens - before.prefix_hit_tokens,
            cached_disk_tokens=now.prefix_disk_hit_tokens - before.prefix_disk_hit_tokens,
            prefilled_tokens=now.prompt_tokens_computed - before.prompt_tokens_computed,
            completion_tokens=completion_tokens, ttft_s=ttft_s, decode_tokens_per_s=decode_tokens_per_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TurnResult:
    text: str
    token_ids: tuple[int, ...]  # generated ids the model saw, without a final end-of-turn token
    finish_reason: str  # stop / length / abort
    stats: TurnStats
    engine_stats: EngineStats  # the snapshot at the end of the turn


def decode_rate(first_token_s: float | None, last_token_s: float | None, tokens: int) -> float | None:
    """Tokens per second after the first (the first one's wait is the TTFT), from the clock at the first and
    the last token; None until there are two tokens apart in time."""
    if first_token_s is None or last_token_s is None or tokens < 2:
        return None
    elapsed_s = last_token_s - first_token_s
    return (tokens - 1) / elapsed_s if elapsed_s > 0 else None


class TurnTracker:
    """Clock and counters of the turn in flight; `live_status` gives the views a consistent picture."""

    def __init__(self, engine: Any, prompt_tokens: int) -> None:
        self.engine = engine
        self.prompt_tokens = prompt_tokens
        self.before = engine.stats()
        self.completion_tokens = 0
        self.ttft_s: float | None = None
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None

    def on_token(self, completion_tokens: int, ttft_s: float | None) -> None:
        now = time.perf_counter()
        if self._first_token_s is None:
            self._first_token_s = now
        self._last_token_s = now
        self.completion_tokens = completion_tokens
        self.ttft_s = ttft_s if ttft_s is not None else self.ttft_s

    def decode_tokens_per_s(self) -> float | None:
        return decode_rate(self._first_token_s, self._last_token_s, self.completion_tokens)

    def stats(self, now: EngineStats) -> TurnStats:
        return TurnStats.between(self.before, now, self.prompt_tokens, self.completion_tokens, self.ttft_s,
                                 self.decode_tokens_per_s())

    def live_status(self) -> tuple[EngineStats, TurnStats]:
        """The pool (with per-block states, for the map) and this turn's figures, from one snapshot."""
        now = self.engine.stats(include_block_states=True)
        return now, self.stats(now)


class StopFlag:
    """Ctrl-C while a reply streams. SIGINT only sets this flag; the turn loop checks it between engine
    steps, so a step (and the block pool) is never left half done. A second Ctrl-C before the turn
    notices raises KeyboardInterrupt, a way out of a prefill that takes too long."""

    def __init__(self) -> None:
        self.requested = False

    def request(self) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.request()

    @contextmanager
    def catching_sigint(self) -> Iterator[StopFlag]:
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def run_turn(engine: Any, prompt_token_ids: Sequence[int], sampling: SamplingParams, tracker: TurnTracker,
             on_text: Callable[[str], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             on_step: Callable[[], None] | None = None) -> TurnResult:
    """Generate one reply; on `should_stop()` the request is aborted and the partial reply kept.

    `on_text` gets each new piece of text; `on_step` is called after every engine step (prefill
    chunks included), between steps, where a view may take a consistent stats snapshot.
    """
    request_id = engine.add_request(list(prompt_token_ids), sampling)
    pieces: list[str] = []
    token_ids: list[int] = []
    finish_reason = "abort"
    finished = False
    while not finished and engine.has_unfinished:
        if should_stop is not None and should_stop():
            engine.abort(request_id)
            break
        for event in engine.step():
            if event.request_id != request_id:
                continue
            token_ids.extend(event.token_ids)
            tracker.on_token(event.completion_tokens, event.ttft_s)
            if event.text:
                pieces.append(event.text)
                if on_text is not None:
                    on_text(event.text)
            if event.finished:
                finish_reason = event.finish_reason or "stop"
                finished = True
        if on_step is not None:
            on_step()
    if finish_reason == "stop" and token_ids and token_ids[-1] in engine.stop_token_ids:
        token_ids.pop()  # the end-of-turn token: the chat template writes it back itself
    now = engine.stats()
    return TurnResult("".join(pieces), tuple(token_ids), finish_reason, tracker.stats(now), now)
