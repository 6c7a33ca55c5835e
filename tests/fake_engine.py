"""A stand-in for pagecli.engine.Engine in `generate` tests that are about files, not models.

EchoEngine answers each prompt with "echo:" and the prompt's first characters, and finishes requests
newest first, so results arrive in reverse input order (`newest_first = False`: in order). It loads
nothing: a property test can run `generate` hundreds of times. Every engine made records the lines it
was asked to run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pagecli.engine import EngineStats, RequestEvent
from pagecli.errors import RequestError
from pagecli.models.messages import read_messages

ECHO_CHARS = 12


class EchoEngine:
    runs: list[list[int]] = []  # per engine made: the input lines it was given, in order
    newest_first = True  # False: requests finish in the order they came

    def __init__(self, model: Any, config: Any, progress: Any = None) -> None:
        self._queue: list[tuple[str, str]] = []
        EchoEngine.runs.append([])

    def add_request(self, prompt: Any, sampling: Any = None, request_id: str | None = None) -> str:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in read_messages(prompt))
        text.encode("utf-8")  # a lone surrogate fails here, as it does in a real tokenizer
        if not text.strip():
            raise RequestError("The prompt is empty.")
        self._queue.append((str(request_id), f"echo:{text[:ECHO_CHARS]}"))
        EchoEngine.runs[-1].append(int(str(request_id)))
        return str(request_id)

    def stream(self) -> Iterator[RequestEvent]:
        while self._queue:
            request_id, text = self._queue.pop(-1 if self.newest_first else 0)
            yield RequestEvent(request_id, text, (1,), True, "stop", len(text), 1, 0, None)

    def stats(self) -> EngineStats:
        zeros = dict.fromkeys(("block_size", "num_blocks", "kv_bytes_per_block", "kv_bytes_total", "weights_bytes",
                               "blocks_free", "blocks_cached", "blocks_active", "blocks_shared", "num_running",
                               "num_waiting", "num_preemptions", "num_steps", "prompt_tokens_computed",
                               "tokens_generated", "prefix_query_tokens", "prefix_hit_tokens",
                               "prefix_disk_hit_tokens", "evictions"), 0)
        return EngineStats(**zeros, device="cpu", dtype="float32", attention_backend="echo", max_model_len=512)

    def take_warnings(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
def echo_engine(monkeypatch) -> type[EchoEngine]:
    """`generate` runs EchoEngine instead of loading a model; `.runs` starts empty."""
    monkeypatch.setattr("pagecli.engine.Engine", EchoEngine)
    EchoEngine.runs = []
    return EchoEngine
