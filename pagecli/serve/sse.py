"""Server-sent events as OpenAI streams them: one `data: {json}` event per chunk, then `data: [DONE]`;
the events of one job's messages, and the streaming response that cancels its job however it ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from pagecli.serve.chat_output import ReplyRules, ReplyStream
from pagecli.serve.engine_thread import EngineThread
from pagecli.serve.jobs import Job
from pagecli.serve.responses import Shape

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class StreamProgress:
    """Which candidates of a streamed job have started and how many are left."""

    def __init__(self, n: int, rules: ReplyRules | None = None) -> None:
        self.left = n
        self.started: set[int] = set()
        # Chat replies read for reasoning or tool calls: one reader per candidate.
        self.replies = None if rules is None or rules.plain else [ReplyStream(rules) for _ in range(n)]

    @property
    def reasoning_tokens(self) -> int | None:
        if self.replies is None or not self.replies[0].rules.reasoning:
            return None
        return sum(reply.reasoning_tokens for reply in self.replies)

    def events(self, message: Any, shape: Shape) -> bytes:
        """The SSE events for one candidate event from the engine thread."""
        index, update = message.index, message.event
        if self.replies is not None:
            return self._read_events(index, update, shape)
        out = b""
        if update.text or index not in self.started:
            out += event(shape.chunk(index, update.text, None, first=index not in self.started))
            self.started.add(index)
        if update.finished:
            self.left -= 1
            out += event(shape.chunk(index, "", update.finish_reason))
        return out

    def _read_events(self, index: int, update: Any, shape: Shape) -> bytes:
        """The events of a candidate whose reply is read: its deltas as the reader lets them out."""
        reply = self.replies[index]  # type: ignore[index]
        out = b""
        if index not in self.started:
            out += event(shape.delta_chunk(index, {"role": "assistant", "content": ""}))
            self.started.add(index)
        deltas = reply.feed(update.text, len(update.token_ids))
        finish_reason = None
        if update.finished:
            rest, finish_reason = reply.finish(update.finish_reason or "stop")
            deltas += rest
        out += b"".join(event(shape.delta_chunk(index, delta)) for delta in deltas)
        if update.finished:
            self.left -= 1
            out += event(shape.delta_chunk(index, {}, finish_reason))
        return out


class JobStream(StreamingResponse):
    """The streamed response of one job (SSE, or NDJSON for Ollama). However it ends (a client gone before
    the first chunk included, when the body generator never starts), whatever of the job still runs is
    cancelled."""

    def __init__(self, body: AsyncIterator[bytes], engine_thread: EngineThread, job: Job,
                 media_type: str = MEDIA_TYPE) -> None:
        super().__init__(body, media_type=media_type, headers=HEADERS)
        self._engine_thread = engine_thread
        self._job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._job.status in ("queued", "running"):
                self._engine_thread.cancel(self._job)
