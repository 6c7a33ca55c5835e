"""The Responses API's stored responses, in memory: what `previous_response_id` continues (the conversation
so far) and what GET /v1/responses/{id} returns. Bounded in count and age, so a long-running server holds
at most `max_count` conversations, none older than `max_age_s`; the oldest go first.

Their KV lives in the prefix cache like any other prompt's, so a continued conversation is served from it
as far as the blocks are still there; this store keeps only the messages.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED = 1000
MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    messages: tuple[dict[str, Any], ...]  # the conversation with this response's reply at the end
    body: dict[str, Any]  # the response object as it was returned
    stored_s: float


class ResponseStore:
    def __init__(self, max_count: int = MAX_STORED, max_age_s: float = MAX_AGE_S) -> None:
        self.max_count = max_count
        self.max_age_s = max_age_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        with self._lock:
            self._items[response_id] = StoredResponse(tuple(messages), body, time.monotonic())
            self._prune()

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._prune()
            return self._items.get(response_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _prune(self) -> None:
        oldest_kept = time.monotonic() - self.max_age_s
        while self._items:
            first = next(iter(self._items.values()))
            if len(self._items) <= self.max_count and first.stored_s >= oldest_kept:
                break
            self._items.popitem(last=False)
