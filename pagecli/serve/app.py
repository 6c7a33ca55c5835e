"""The HTTP routes (Starlette): OpenAI's /v1/chat/completions, /v1/completions, /v1/responses and
/v1/models, Anthropic's /v1/messages, Ollama's /api/*, the web page at / and its pool state at /v1/pool,
plus /health and /metrics. Every completion goes through one RequestPath; each API is a translation
module over it. Handlers never touch the Engine and never block its thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagecli.config import SamplingParams
from pagecli.models.tool_calls import HERMES
from pagecli.serve import anthropic_messages, ollama_api, openai_responses, web_page
from pagecli.serve.engine_thread import EngineThread
from pagecli.serve.errors import ApiError, server_error
from pagecli.serve.metrics import CONTENT_TYPE, ServerMetrics
from pagecli.serve.ollama_api import ModelFacts
from pagecli.serve.openai_chat import OpenAIChat
from pagecli.serve.pool_view import RecentTurns, pool_state
from pagecli.serve.request_log import RequestLog
from pagecli.serve.request_path import RequestPath
from pagecli.serve.response_store import ResponseStore
from pagecli.serve.responses import model_card


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
    recent: RecentTurns = field(default_factory=RecentTurns)  # the last finished requests, for /v1/pool
    stored: ResponseStore = field(default_factory=ResponseStore)  # Responses API: previous_response_id
    facts: ModelFacts | None = None  # what Ollama's /api/tags, /api/show and /api/ps say of the model
    adapter_names: tuple[str, ...] = ()  # LoRA adapters (--lora): /v1/models lists them, `model` may name them


def create_app(state: ServeState) -> Starlette:
    api = _Api(state)
    routes = [
        Route("/", api.page), Route("/health", api.health), Route("/metrics", api.metrics),
        Route("/v1/models", api.models), Route("/v1/pool", api.pool),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        *openai_responses.routes(state, api.path),
        *anthropic_messages.routes(state, api.path),
        *ollama_api.routes(state, api.path),
    ]
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """An unknown route or method, answered in the shape of the API its path belongs to."""
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code)
    return _shape_for(request.url.path)(error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _shape_for(request.url.path)(server_error())  # Starlette logs the traceback: a bug, not the client's


def _shape_for(path: str) -> Any:
    if path.startswith("/api/"):
        return ollama_api.error_response
    if path.startswith("/v1/messages"):
        return anthropic_messages.error_response
    return ApiError.response


class _Api:
    def __init__(self, state: ServeState) -> None:
        self.s = state
        self.path = RequestPath(state)

    async def page(self, request: Request) -> Response:
        return web_page.response()

    async def health(self, request: Request) -> Response:
        ok = self.s.engine_thread.accepting
        return JSONResponse({"status": "ok" if ok else "shutting_down"}, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.s.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        try:
            self.path.authorize(request)
        except ApiError as error:
            return self.path.refused(request.url.path, error, method="GET")
        base = self.s.model_ids[0]
        adapters = [{**model_card(name, self.s.created), "parent": base} for name in self.s.adapter_names]
        return JSONResponse({"object": "list", "data": [model_card(base, self.s.created), *adapters]})

    async def pool(self, request: Request) -> Response:
        """The block pool, the running requests and the last turns, as JSON (docs/serve-api.md)."""
        try:
            self.path.authorize(request)
        except ApiError as error:
            return self.path.refused(request.url.path, error, method="GET")
        thread = self.s.engine_thread
        thread.watch_blocks()
        return JSONResponse(pool_state(self.s.model_ids[0], thread.snapshot, thread.running_jobs(),
                                       thread.pending, self.s.recent.turns()))

    async def chat(self, request: Request) -> Response:
        return await self.path.answer(request, OpenAIChat(self.s, "chat"))

    async def completions(self, request: Request) -> Response:
        return await self.path.answer(request, OpenAIChat(self.s, "completion"))
