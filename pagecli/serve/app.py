"""The HTTP routes (Starlette): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus
/health and /metrics. Handlers check a request, hand it to the engine thread as a Job and turn what
comes back into a JSON body or an SSE stream; they never touch the Engine and never block its thread.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagecli.config import SamplingParams
from pagecli.models.tool_calls import HERMES
from pagecli.serve import sse
from pagecli.serve.chat_output import ReplyRules, ReplyStream, message_of
from pagecli.serve.engine_thread import EngineThread
from pagecli.serve.errors import ApiError, server_error
from pagecli.serve.jobs import Accepted, Job, Rejected, Sink
from pagecli.serve.metrics import CONTENT_TYPE, ServerMetrics
from pagecli.serve.request_log import RequestLog
from pagecli.serve.responses import Shape, model_card, usage
from pagecli.serve.validation import ApiRequest, parse_json, parse_request

MAX_BODY_BYTES = 16 << 20  # a request body; the prompt inside it is bounded by the context long before
CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer: logged, never sent


@dataclass
class ServeState:
    engine_thread: EngineThread
    model_ids: tuple[str, ...]  # the first is the id /v1/models lists; requests may name any of them
    api_key: str | None
    sampling: SamplingParams  # the profile's and flags' sampling settings, under each request's fields
    metrics: ServerMetrics
    log: RequestLog
    created: int
    reasoning: bool = True  # --reasoning-format separate: <think> text goes to reasoning_content
    opens_thinking: bool = False  # the chat template's generation prompt ends inside <think>
    tool_format: str = HERMES  # how the chat template writes tool calls (tool_calls.tool_format_of)


def create_app(state: ServeState) -> Starlette:
    api = _Api(state)
    routes = [
        Route("/health", api.health), Route("/metrics", api.metrics), Route("/v1/models", api.models),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    return server_error().response()  # Starlette logs the traceback: this is a bug, not the client's doing


class _Api:
    def __init__(self, state: ServeState) -> None:
        self.s = state

    async def health(self, request: Request) -> Response:
        ok = self.s.engine_thread.accepting
        return JSONResponse({"status": "ok" if ok else "shutting_down"}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.s.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as error:
            return self._refused(request.url.path, error, method="GET")
        return JSONResponse({"object": "list", "data": [model_card(self.s.model_ids[0], self.s.created)]})

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, "completion")

    # --- one completion request --------------------------------------------------------------
    async def _answer(self, request: Request, kind: str) -> Response:
        path, job = request.url.path, None
        try:
            self._authorize(request)
            api_request = parse_request(parse_json(await _bounded_body(request)), kind, self.s.sampling)
            self._check_model(api_request.model)
            job = Job(kind, api_request.prompt, api_request.sampling, Sink(asyncio.get_running_loop()))
            self.s.engine_thread.submit(job)
            await self._accepted(job)
            shape = Shape.of(job, api_request.model or self.s.model_ids[0])
            rules = self._rules(api_request)
            if api_request.stream:
                body = self._stream(path, job, shape, api_request, rules)
                return sse.JobStream(body, self.s.engine_thread, job)
            return await self._complete(request, path, job, shape, rules)
        except ApiError as error:
            return self._refused(path, error, job)
        except ClientDisconnect:
            self._answered(path, CLIENT_CLOSED, job, "the client left while sending the request")
            return Response(status_code=CLIENT_CLOSED)

    def _authorize(self, request: Request) -> None:
        if self.s.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not header:
            raise ApiError(401, "No API key: send the header 'Authorization: Bearer KEY'.", "missing_api_key")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.s.api_key.encode()):
            raise ApiError(401, "Incorrect API key.", "invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.s.model_ids:
            raise ApiError(404, f"The model '{model}' is not served here; this server serves "
                                f"'{self.s.model_ids[0]}' (GET /v1/models).", "model_not_found", param="model")

    def _rules(self, api_request: ApiRequest) -> ReplyRules | None:
        """How the request's replies are read: None for completions (their text is returned as it is)."""
        if api_request.kind != "chat":
            return None
        tools = api_request.tools
        parses_calls = tools is not None and tools.parses_calls
        return ReplyRules(self.s.reasoning, self.s.opens_thinking, self.s.tool_format if parses_calls else None,
                          parses_calls and tools.constrained)  # type: ignore[union-attr]

    async def _accepted(self, job: Job) -> None:
        message = await job.sink.get()
        if isinstance(message, Rejected):
            raise message.error
        assert isinstance(message, Accepted)

    async def _complete(self, request: Request, path: str, job: Job, shape: Shape,
                        rules: ReplyRules | None) -> Response:
        collect = asyncio.ensure_future(_collect(job, rules))
        gone = asyncio.ensure_future(_client_gone(request))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if collect not in done:
            collect.cancel()
            self.s.engine_thread.cancel(job)
            self._answered(path, CLIENT_CLOSED, job, "the client disconnected; request cancelled")
            return Response(status_code=CLIENT_CLOSED)
        texts, reasons, read = collect.result()  # raises the ApiError of a job the server had to cancel
        self._answered(path, 200, job)
        if read is None:
            return JSONResponse(shape.completion(texts, reasons, usage(job)))
        replies, reasoning_tokens = read
        messages = [message_of(deltas) for deltas, _ in replies]
        reasons = [reason for _, reason in replies]
        return JSONResponse(shape.completion(texts, reasons, usage(job, reasoning_tokens), messages))

    async def _stream(self, path: str, job: Job, shape: Shape, api_request: ApiRequest,
                      rules: ReplyRules | None) -> AsyncIterator[bytes]:
        """The SSE body. A client that disconnects cancels this generator, which cancels the job."""
        progress = sse.StreamProgress(job.n, rules)
        try:
            while progress.left and progress.error is None:
                yield b"".join(progress.events(message, shape) for message in await job.sink.get_ready())
            if api_request.include_usage and progress.error is None:
                yield sse.event(shape.usage_chunk(usage(job, progress.reasoning_tokens)))
            yield sse.DONE
        finally:
            if progress.left and progress.error is None:
                self.s.engine_thread.cancel(job)
                progress.status, progress.error = CLIENT_CLOSED, "the client disconnected; request cancelled"
            self._answered(path, progress.status, job, progress.error)

    def _refused(self, path: str, error: ApiError, job: Job | None = None, method: str = "POST") -> Response:
        self._answered(path, error.status, job, error.message, method)
        return error.response()

    def _answered(self, path: str, status: int, job: Job | None, error: str | None = None,
                  method: str = "POST") -> None:
        self.s.metrics.answered(path, status)
        self.s.log.answered(method, path, status, job, error)


Replies = list[tuple[list[dict[str, Any]], str]]  # per candidate: its reply's deltas, its finish reason


async def _collect(job: Job, rules: ReplyRules | None
                   ) -> tuple[list[str], list[str], tuple[Replies, int | None] | None]:
    """Every candidate's text and finish reason, once all have finished; and where replies are read,
    what each reads as (fed event by event, as a stream is, so reasoning tokens are counted the same)."""
    texts: list[list[str]] = [[] for _ in range(job.n)]
    reasons: list[str] = ["stop"] * job.n
    readers = None if rules is None or rules.plain else [ReplyStream(rules) for _ in range(job.n)]
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


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so only that message can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _bounded_body(request: Request) -> bytes:
    """The request's body, read only up to MAX_BODY_BYTES: a larger one is a 413 before it fills memory
    (its prompt could not fit any model's context anyway)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _body_too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _body_too_large()
    return bytes(body)


def _body_too_large() -> ApiError:
    return ApiError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt.",
                    "request_too_large")
