"""A job: one HTTP request's candidates in the engine, what the engine thread tells its handler, and the
timings the metrics and the request table read. The engine thread writes a job; others only read it."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagecli.config import SamplingParams
from pagecli.engine.engine import RequestEvent
from pagecli.serve.errors import ApiError

_NUMBERS = itertools.count(1)


@dataclass(frozen=True)
class Accepted:
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    error: ApiError


@dataclass(frozen=True)
class CandidateEvent:
    index: int
    event: RequestEvent


class Sink:
    """The handler's inbox: the engine thread puts messages here through the handler's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, message: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, message)
        except RuntimeError:  # the handler's loop has closed: nobody is listening any more
            pass

    async def get(self) -> Any:
        return await self._queue.get()

    async def get_ready(self) -> list[Any]:
        """The next message and every one already queued behind it: a stream sends them as one write,
        and waits (letting the loop see a disconnect) only when nothing is queued."""
        messages = [await self._queue.get()]
        while not self._queue.empty():
            messages.append(self._queue.get_nowait())
        return messages


@dataclass
class Job:
    """One request's candidates (n of them) and its progress, as the request table shows it."""

    kind: str  # "chat" or "completion"
    prompt: Any
    sampling: SamplingParams  # its n candidates are one engine request, forked by the engine
    sink: Sink
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    number: int = field(default_factory=lambda: next(_NUMBERS))
    arrival_s: float = field(default_factory=time.perf_counter)
    status: str = "queued"  # queued, running, done, cancelled, error
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of candidate replies read for reasoning, once they have finished
    first_token_s: float | None = None
    finished_s: float | None = None
    last_token_s: dict[int, float] = field(default_factory=dict)
    candidates_left: int = 0

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def tokens_per_s(self, now_s: float) -> float | None:
        if self.first_token_s is None or self.completion_tokens < 2:
            return None
        end = self.finished_s or now_s
        return (self.completion_tokens - 1) / max(end - self.first_token_s, 1e-9)


class JobObserver(Protocol):
    """What the metrics and the request table hear from the engine thread."""

    def admitted(self, job: Job) -> None: ...

    def token(self, job: Job, inter_token_s: float | None) -> None: ...

    def finished(self, job: Job) -> None: ...
