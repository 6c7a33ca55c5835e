"""OpenAI's Chat Completions and Completions APIs as a translation over the common request path: the body
read by validation.py, replies shaped by responses.py, streamed as sse.py's chunks (n candidates each)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from pagecli.serve import sse
from pagecli.serve.chat_output import ReplyRules, ReplyStream, message_of
from pagecli.serve.errors import ApiError
from pagecli.serve.jobs import Job, Rejected
from pagecli.serve.request_path import reply_rules
from pagecli.serve.responses import Shape, usage
from pagecli.serve.validation import ApiRequest, parse_request


class OpenAIChat:
    """One /v1/chat/completions (kind "chat") or /v1/completions (kind "completion") request."""

    media_type = sse.MEDIA_TYPE

    def __init__(self, state: Any, kind: str) -> None:
        self.s = state
        self.kind = kind
        self.request: ApiRequest | None = None
        self.rules = ReplyRules()

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        self.request = parse_request(body, self.kind, self.s.sampling)
        self.rules = reply_rules(self.s, self.request)
        return self.request

    def error_response(self, error: ApiError) -> Response:
        return error.response()

    def _shape(self, job: Job) -> Shape:
        assert self.request is not None
        return Shape.of(job, self.request.model or self.s.model_ids[0])

    async def complete(self, job: Job) -> Response:
        texts, reasons, read = await _collect(job, None if self.rules.plain else self.rules)
        shape = self._shape(job)
        if read is None:
            return JSONResponse(shape.completion(texts, reasons, usage(job)))
        replies, reasoning_tokens = read
        messages = [message_of(deltas) for deltas, _ in replies]
        reasons = [reason for _, reason in replies]
        return JSONResponse(shape.completion(texts, reasons, usage(job, reasoning_tokens), messages))

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        assert self.request is not None
        shape, progress = self._shape(job), sse.StreamProgress(job.n, self.rules)
        while progress.left:
            out = b""
            for message in await job.sink.get_ready():
                if isinstance(message, Rejected):
                    yield out
                    raise message.error
                out += progress.events(message, shape)
            yield out
        if self.request.include_usage:
            yield sse.event(shape.usage_chunk(usage(job, progress.reasoning_tokens)))
        yield sse.DONE

    def stream_error(self, error: ApiError) -> bytes:
        return sse.event(error.body()) + sse.DONE


Replies = list[tuple[list[dict[str, Any]], str]]  # per candidate: its reply's deltas, its finish reason


async def _collect(job: Job, rules: ReplyRules | None
                   ) -> tuple[list[str], list[str], tuple[Replies, int | None] | None]:
    """Every candidate's text and finish reason, once all have finished; and where replies are read,
    what each reads as (fed event by event, as a stream is, so reasoning tokens are counted the same)."""
    texts: list[list[str]] = [[] for _ in range(job.n)]
    reasons: list[str] = ["stop"] * job.n
    readers = None if rules is None else [ReplyStream(rules) for _ in range(job.n)]
    replies: Replies = [([], "stop") for _ in range(job.n)]
    left = job.n
    while left:
        message = await job.sink.get()
        if isinstance(message, Rejected):
            raise message.error
        update, index = message.event, message.index
        texts[index].append(update.text)
        if readers is not None:
            replies[index][0].extend(readers[index].feed(update.text, len(update.token_ids)))
        if update.finished:
            reasons[index] = update.finish_reason or "stop"
            if readers is not None:
                rest, reason = readers[index].finish(reasons[index])
                replies[index] = (replies[index][0] + rest, reason)
            left -= 1
    reasoning = None
    if readers is not None and readers[0].rules.reasoning:
        reasoning = sum(reader.reasoning_tokens for reader in readers)
    return ["".join(parts) for parts in texts], reasons, None if readers is None else (replies, reasoning)
