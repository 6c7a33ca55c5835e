"""The pool state as JSON for GET /v1/pool: the engine's stats snapshot (the same EngineStats the terminal
panel draws), each block's state as one letter, the requests in the engine and the last finished turns.
The web page polls it; `EngineStats.from_dict` (engine_stats_of here) rebuilds the snapshot on a client's side, so a terminal client
draws the very panel `pagecli chat` draws (docs/serve-api.md describes every field).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagecli.engine.stats import BLOCK_LETTERS, EngineStats
from pagecli.serve.jobs import Job

POOL_OBJECT = "pagecli.pool"
STATE_LETTERS = BLOCK_LETTERS  # the letters of block_map (engine/stats.py keeps them for clients too)
RECENT_TURNS = 16


@dataclass(frozen=True)
class Turn:
    """One finished request, as the pool view lists it."""

    number: int
    kind: str
    status: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    tokens_per_s: float | None
    finished_at: float  # seconds since the epoch

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "kind": self.kind, "status": self.status,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefilled_tokens": self.prompt_tokens - self.cached_tokens,
                "completion_tokens": self.completion_tokens, "ttft_s": _rounded(self.ttft_s),
                "tokens_per_s": _rounded(self.tokens_per_s), "finished_at": round(self.finished_at, 3)}


class RecentTurns:
    """A JobObserver keeping the last finished requests (the engine thread adds, handlers read)."""

    def __init__(self, keep: int = RECENT_TURNS) -> None:
        self._turns: deque[Turn] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def admitted(self, job: Job) -> None:
        pass

    def token(self, job: Job, inter_token_s: float | None) -> None:
        pass

    def finished(self, job: Job) -> None:
        turn = Turn(job.number, job.kind, job.status, job.prompt_tokens, job.cached_tokens, job.completion_tokens,
                    job.ttft_s, job.tokens_per_s(time.perf_counter()), time.time())
        with self._lock:
            self._turns.append(turn)

    def turns(self) -> list[Turn]:
        """Newest first."""
        with self._lock:
            return list(reversed(self._turns))


def pool_state(model: str, stats: EngineStats, jobs: Sequence[Job], pending: int,
               turns: Sequence[Turn]) -> dict[str, Any]:
    now = time.perf_counter()
    return {
        "object": POOL_OBJECT,
        "model": model,
        "stats": stats.to_dict(),
        "block_map": stats.block_map(),
        "pending": pending,
        "requests": [_request(job, now) for job in jobs],
        "turns": [turn.to_dict() for turn in turns],
    }


def _request(job: Job, now_s: float) -> dict[str, Any]:
    return {"number": job.number, "kind": job.kind, "n": job.n,
            "status": job.status if job.first_token_s else "prefill",
            "prompt_tokens": job.prompt_tokens, "cached_tokens": job.cached_tokens,
            "prefilled_tokens": job.prompt_tokens - job.cached_tokens,
            "completion_tokens": job.completion_tokens, "ttft_s": _rounded(job.ttft_s),
            "tokens_per_s": _rounded(job.tokens_per_s(now_s))}


def engine_stats_of(state: dict[str, Any]) -> EngineStats:
    """The EngineStats a /v1/pool answer carries (block states from its block_map), for a client's panel."""
    return EngineStats.from_dict(state["stats"], state.get("block_map"))


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
