"""The one request path every API runs through: authorize, read a bounded body, let the API's translation
read it into an ApiRequest, hand that to the engine thread as a Job, and answer whole or streamed, the
request logged and counted once. The APIs (openai_chat, openai_responses, anthropic_messages, ollama_api)
are translations: they read their request shape and write their reply shape, nothing else.

A translation is made per request, so what it read (a stop sequence, a stored conversation) stays with it.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pagecli.serve import sse
from pagecli.serve.chat_output import ReplyRules, ReplyStream, message_of
from pagecli.serve.errors import ApiError
from pagecli.serve.jobs import Accepted, Job, Rejected, Sink
from pagecli.serve.validation import ApiRequest, parse_json

CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer: logged, never sent
MAX_BODY_BYTES = 8 << 20  # a request body past this is a 413, read no further


class ErrorShape(Protocol):
    def error_response(self, error: ApiError) -> Response:
        """The error in this API's own shape."""


class Translation(ErrorShape, Protocol):
    """One API's request and reply shapes over the common path."""

    media_type: str  # of a streamed reply

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        """The request in common terms; ApiError (4xx) for any mistake in it."""

    async def complete(self, job: Job) -> Response:
        """The whole reply, once the job has finished (reads the job's sink; raises a Rejected job's error)."""

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        """The streamed reply; raises ApiError when the job is rejected on the way."""

    def stream_error(self, error: ApiError) -> bytes:
        """The last bytes of a stream whose job failed after it started."""


@dataclass(frozen=True)
class ReplyPiece:
    """What one engine event added to one candidate's reply, read by its ReplyStream."""

    index: int
    deltas: list[dict[str, Any]]  # content / reasoning_content / tool_calls deltas, as chat_output makes them
    token_ids: tuple[int, ...]
    finish_reason: str | None  # set on the candidate's last piece (tool_calls where it made calls)


@dataclass(frozen=True)
class Reply:
    """One candidate's whole reply."""

    message: dict[str, Any]  # role, content, and reasoning_content / tool_calls where the reply had them
    finish_reason: str
    reasoning_tokens: int
    token_ids: tuple[int, ...]  # what the model generated (a final end-of-turn token included)


def reply_rules(state: Any, api_request: ApiRequest) -> ReplyRules:
    """How a request's replies are read: reasoning split off, tool calls parsed (chat only)."""
    if api_request.kind != "chat":
        return ReplyRules()
    tools = api_request.tools
    parses_calls = tools is not None and tools.parses_calls
    return ReplyRules(state.reasoning, state.opens_thinking, state.tool_format if parses_calls else None,
                      parses_calls and tools.constrained)  # type: ignore[union-attr]


async def reply_pieces(job: Job, rules: ReplyRules) -> AsyncIterator[list[ReplyPiece]]:
    """The job's replies as they come, one list per batch of engine messages; ApiError for a rejected job."""
    readers = [ReplyStream(rules) for _ in range(job.n)]
    left = job.n
    while left:
        pieces = []
        for message in await job.sink.get_ready():
            if isinstance(message, Rejected):
                if pieces:
                    yield pieces
                raise message.error
            update, reader = message.event, readers[message.index]
            deltas = reader.feed(update.text, len(update.token_ids))
            reason = None
            if update.finished:
                rest, reason = reader.finish(update.finish_reason or "stop")
                deltas += rest
                left -= 1
            pieces.append(ReplyPiece(message.index, deltas, update.token_ids, reason))
        yield pieces
    job.reasoning_tokens = sum(reader.reasoning_tokens for reader in readers)


async def whole_reply(job: Job, rules: ReplyRules) -> Reply:
    """Candidate 0's reply once it has finished (the APIs past OpenAI's chat take one candidate)."""
    deltas: list[dict[str, Any]] = []
    token_ids: list[int] = []
    reason = "stop"
    async for pieces in reply_pieces(job, rules):
        for piece in pieces:
            deltas += piece.deltas
            token_ids += piece.token_ids
            reason = piece.finish_reason or reason
    return Reply(message_of(deltas), reason, job.reasoning_tokens, tuple(token_ids))


class RequestPath:
    """The steps every API's request takes; `state` is the server's ServeState."""

    def __init__(self, state: Any) -> None:
        self.s = state

    async def answer(self, request: Request, api: Translation) -> Response:
        path, job = request.url.path, None
        try:
            self.authorize(request)
            api_request = api.parse(parse_json(await read_body(request)))
            self.check_model(api_request.model)
            job = await self.start(self.with_adapter(api_request))
            if api_request.stream:
                return sse.JobStream(self._stream(path, job, api), self.s.engine_thread, job, api.media_type)
            return await self._complete(request, path, job, api)
        except ApiError as error:
            return self.refused(path, error, api, job)
        except ClientDisconnect:
            self.answered(path, CLIENT_CLOSED, job, "the client left while sending the request")
            return Response(status_code=CLIENT_CLOSED)

    def authorize(self, request: Request) -> None:
        """--api-key as `Authorization: Bearer KEY` (OpenAI, Ollama) or `x-api-key: KEY` (Anthropic)."""
        if self.s.api_key is None:
            return
        expected = self.s.api_key.encode()
        key = request.headers.get("x-api-key")
        if key is None:
            header = request.headers.get("authorization", "")
            if not header:
                raise ApiError(401, "No API key: send the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY').",
                               "missing_api_key")
            scheme, _, key = header.partition(" ")
            if scheme.lower() != "bearer":
                key = ""
        if not hmac.compare_digest(key.strip().encode(), expected):
            raise ApiError(401, "Incorrect API key.", "invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.s.model_ids and model not in self.s.adapter_names:
            raise ApiError(404, f"The model '{model}' is not served here; this server serves "
                                f"'{self.s.model_ids[0]}' (GET /v1/models).", "model_not_found", param="model")

    def with_adapter(self, api_request: ApiRequest) -> ApiRequest:
        """A request whose `model` names a LoRA adapter runs it (as vLLM serves adapters as models), unless
        its own `lora` field names one."""
        if api_request.model in self.s.adapter_names and api_request.sampling.lora is None:
            return replace(api_request, sampling=replace(api_request.sampling, lora=api_request.model))
        return api_request

    async def start(self, api_request: ApiRequest) -> Job:
        """The request's job, admitted by the engine thread (its prompt tokenized and within limits)."""
        job = Job(api_request.kind, api_request.prompt, api_request.sampling, Sink(asyncio.get_running_loop()))
        self.s.engine_thread.submit(job)
        message = await job.sink.get()
        if isinstance(message, Rejected):
            raise message.error
        assert isinstance(message, Accepted)
        return job

    async def _complete(self, request: Request, path: str, job: Job, api: Translation) -> Response:
        response = await self.unless_gone(request, job, api.complete(job))
        if response is None:
            self.answered(path, CLIENT_CLOSED, job, "the client disconnected; request cancelled")
            return Response(status_code=CLIENT_CLOSED)
        self.answered(path, 200, job)
        return response

    async def unless_gone(self, request: Request, job: Job, work: Awaitable[Response]) -> Response | None:
        """`work`'s response, or None (the job cancelled) when the client disconnects first."""
        done_future = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_client_gone(request))
        done, _ = await asyncio.wait({done_future, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if done_future not in done:
            done_future.cancel()
            self.s.engine_thread.cancel(job)
            return None
        return done_future.result()  # raises the ApiError of a job the server had to cancel

    async def _stream(self, path: str, job: Job, api: Translation) -> AsyncIterator[bytes]:
        """The streamed body. A client that disconnects cancels this generator, which cancels the job."""
        status, error, ended = 200, None, False
        try:
            try:
                async for chunk in api.stream(job):
                    if chunk:  # a batch of engine messages that added nothing to send
                        yield chunk
            except ApiError as failure:
                status, error = failure.status, failure.message
                yield api.stream_error(failure)
            ended = True
        finally:
            if not ended:
                self.s.engine_thread.cancel(job)
                status, error = CLIENT_CLOSED, "the client disconnected; request cancelled"
            self.answered(path, status, job, error)

    def refused(self, path: str, error: ApiError, api: ErrorShape | None = None, job: Job | None = None,
                method: str = "POST", endpoint: str | None = None) -> Response:
        self.answered(path, error.status, job, error.message, method, endpoint)
        return api.error_response(error) if api is not None else error.response()

    def answered(self, path: str, status: int, job: Job | None, error: str | None = None,
                 method: str = "POST", endpoint: str | None = None) -> None:
        """Counted under `endpoint` (a route with a parameter: its template, so /metrics keeps few series),
        logged under the path."""
        self.s.metrics.answered(endpoint or path, status)
        self.s.log.answered(method, path, status, job, error)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, or a 413 as soon as it (or its Content-Length) passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit >> 20} MiB; send a smaller one.",
                    "request_too_large")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only that message can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
