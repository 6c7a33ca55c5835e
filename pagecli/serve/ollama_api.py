"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version) as a translation over
the common request path: messages, `format` (json or a schema), `options` and `tools` become a chat request
that validation.py checks; replies stream as newline-delimited JSON with Ollama's timing fields (durations in
nanoseconds, token counts). A field or option this server cannot honour is refused by name (400), never
dropped. Errors take Ollama's shape: {"error": "..."}.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import pagecli
from pagecli.serve.chat_output import ReplyRules
from pagecli.serve.errors import ApiError, bad_request, renamed
from pagecli.serve.jobs import Job
from pagecli.serve.request_path import RequestPath, read_body, reply_pieces, reply_rules, whole_reply
from pagecli.serve.validation import ApiRequest, parse_json, parse_request

MEDIA_TYPE = "application/x-ndjson"
# Ollama's option -> pagecli's sampling field; any other option is refused by name.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
_OLLAMA_NAMES = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty", "response_format": "format"}
# Top-level fields, and the values of each that ask for nothing this server lacks (empty: any value).
_FIELDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "chat": {"model": (), "messages": (), "tools": (), "format": (), "options": (), "stream": (), "think": (),
             "keep_alive": ()},
    "generate": {"model": (), "prompt": (), "system": (), "raw": (), "format": (), "options": (), "stream": (),
                 "think": (), "keep_alive": (), "suffix": (None, ""), "template": (None, ""), "context": (None, []),
                 "images": (None, [])},
}
_FAR_FUTURE = "2999-01-01T00:00:00Z"  # /api/ps expires_at: the model stays loaded while the server runs


@dataclass(frozen=True)
class ModelFacts:
    """What /api/tags, /api/show and /api/ps say about the served model, read once at start."""

    family: str
    parameter_count: int
    quantization: str
    size_bytes: int
    context_length: int
    digest: str
    template: str
    loaded_at: str  # RFC 3339

    @classmethod
    def of(cls, engine: Any) -> ModelFacts:
        spec = getattr(getattr(engine, "loaded", None), "spec", None)
        stats = engine.stats()
        fingerprint = str(getattr(engine, "fingerprint", engine.model_name))
        return cls(family=getattr(spec, "model_type", "unknown"), parameter_count=_parameter_count(spec),
                   quantization=stats.quantize if stats.quantize != "none" else stats.dtype.upper(),
                   size_bytes=stats.weights_bytes + stats.kv_bytes_total, context_length=engine.max_model_len,
                   digest=hashlib.sha256(fingerprint.encode()).hexdigest(),
                   template=getattr(engine, "chat_template", None) or "", loaded_at=_now())


def _parameter_count(spec: Any) -> int:
    if spec is None:
        return 0
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    layer = spec.hidden_size * (2 * q + 2 * kv) + 3 * spec.hidden_size * spec.intermediate_size + 2 * spec.hidden_size
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * layer + embeddings + spec.hidden_size


def routes(state: Any, path: RequestPath) -> list[Route]:
    async def chat(request: Request) -> Response:
        return await path.answer(request, OllamaApi(state, "chat"))

    async def generate(request: Request) -> Response:
        return await path.answer(request, OllamaApi(state, "generate"))

    def listing(build: Any, method: str = "GET") -> Any:
        async def handler(request: Request) -> Response:
            try:
                path.authorize(request)
                body = await build(request)
            except ApiError as error:
                return path.refused(request.url.path, error, _OllamaErrors(), method=method)
            path.answered(request.url.path, 200, None, method=method)
            return JSONResponse(body)
        return handler

    async def tags(request: Request) -> dict[str, Any]:
        return {"models": [_model_entry(state)]}

    async def ps(request: Request) -> dict[str, Any]:
        facts = state.facts
        return {"models": [{**_model_entry(state), "expires_at": _FAR_FUTURE, "size_vram": 0,
                            "context_length": facts.context_length}]}

    async def show(request: Request) -> dict[str, Any]:
        body = parse_json(await read_body(request))
        name = body.get("model", body.get("name"))
        if not isinstance(name, str):
            raise bad_request("'model' is required (a string).")
        check_model(state, name)
        facts = state.facts
        return {"modelfile": f"# served by pagecli {pagecli.__version__}\nFROM {state.model_ids[0]}\n",
                "parameters": "", "template": facts.template, "details": _details(facts),
                "model_info": {"general.architecture": facts.family, "general.parameter_count": facts.parameter_count,
                               f"{facts.family}.context_length": facts.context_length},
                "capabilities": ["completion", "tools"], "modified_at": facts.loaded_at}

    async def version(request: Request) -> dict[str, Any]:
        return {"version": pagecli.__version__}

    return [Route("/api/chat", chat, methods=["POST"]), Route("/api/generate", generate, methods=["POST"]),
            Route("/api/tags", listing(tags)), Route("/api/ps", listing(ps)),
            Route("/api/show", listing(show, "POST"), methods=["POST"]), Route("/api/version", listing(version))]


def error_response(error: ApiError) -> Response:
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)


class _OllamaErrors:
    def error_response(self, error: ApiError) -> Response:
        return error_response(error)


def check_model(state: Any, name: str) -> None:
    if name.removesuffix(":latest") not in state.model_ids:
        raise ApiError(404, f"model '{name}' not found; this server serves '{state.model_ids[0]}' (GET /api/tags).")


def _model_entry(state: Any) -> dict[str, Any]:
    facts = state.facts
    name = state.model_ids[0]
    return {"name": name, "model": name, "modified_at": facts.loaded_at, "size": facts.size_bytes,
            "digest": facts.digest, "details": _details(facts)}


def _details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": facts.family, "families": [facts.family],
            "parameter_size": _short_count(facts.parameter_count), "quantization_level": facts.quantization}


def _short_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}".replace(".0", "")
    return str(count)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class OllamaApi:
    """One /api/chat or /api/generate request."""

    media_type = MEDIA_TYPE

    def __init__(self, state: Any, endpoint: str) -> None:
        self.s = state
        self.endpoint = endpoint  # "chat" or "generate"
        self.model = ""
        self.rules = ReplyRules()

    # --- the request ----------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> ApiRequest:
        _refuse_unknown(body, self.endpoint)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required (a string).")
        check_model(self.s, model)
        self.model = model
        if body.get("keep_alive") in (0, "0", "0s", "0m"):
            raise bad_request("'keep_alive' 0 asks to unload the model; pagecli serve keeps it loaded while it runs.")
        think = body.get("think")
        if think not in (None, True, False):
            raise bad_request("'think' must be true or false (thinking levels are not supported).")
        kind, prompt = self._prompt(body)
        request_body = {"stream": body.get("stream", True), "response_format": _format(body.get("format")),
                        **_options(body.get("options"), self.s.engine_thread.engine.max_model_len)}
        if self.endpoint == "chat":
            request_body["messages"] = prompt
            if body.get("tools") is not None:
                request_body["tools"] = body["tools"]
        else:
            request_body["prompt" if kind == "completion" else "messages"] = prompt
        try:
            request = parse_request({k: v for k, v in request_body.items() if v is not None}, kind, self.s.sampling)
        except ApiError as error:
            raise renamed(error, _OLLAMA_NAMES) from None
        request = ApiRequest(request.kind, None, request.prompt, request.sampling, request.n, request.stream,
                             request.include_usage, request.tools)  # the model was checked by its Ollama name
        rules = reply_rules(self.s, request)
        self.rules = rules if think is not False else ReplyRules(False, False, rules.tool_format, rules.calls_only)
        return request

    def _prompt(self, body: dict[str, Any]) -> tuple[str, Any]:
        if self.endpoint == "chat":
            return "chat", _chat_messages(body.get("messages"))
        prompt, system = body.get("prompt"), body.get("system")
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string.")
        if system is not None and not isinstance(system, str):
            raise bad_request("'system' must be a string.")
        if body.get("raw"):
            if system:
                raise bad_request("'system' cannot be used with 'raw': a raw prompt is sent as it is.")
            return "completion", prompt
        return "chat", ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]

    def error_response(self, error: ApiError) -> Response:
        return error_response(error)

    # --- the reply ------------------------------------------------------------------------------
    async def complete(self, job: Job) -> Response:
        reply = await whole_reply(job, self.rules)
        return JSONResponse(self._line(reply.message, done=True, finish_reason=reply.finish_reason, job=job))

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        reason = "stop"
        async for pieces in reply_pieces(job, self.rules):
            out = b""
            for piece in pieces:
                reason = piece.finish_reason or reason
                message = _message_of(piece.deltas)
                if message:
                    out += _ndjson(self._line(message, done=False))
            yield out
        yield _ndjson(self._line({}, done=True, finish_reason=reason, job=job))

    def stream_error(self, error: ApiError) -> bytes:
        return _ndjson({"error": error.message})

    def _line(self, message: dict[str, Any], done: bool, finish_reason: str | None = None,
              job: Job | None = None) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.endpoint == "chat":
            line["message"] = _ollama_message(message)
        else:
            line["response"] = message.get("content") or ""
            if message.get("reasoning_content"):
                line["thinking"] = message["reasoning_content"]
        line["done"] = done
        if done and job is not None:
            line["done_reason"] = "length" if finish_reason == "length" else "stop"
            line.update(_timings(job))
        return line


def _ndjson(line: dict[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def _message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """What a stream line carries of some deltas: its text, thinking and any whole tool calls."""
    message: dict[str, Any] = {}
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [part for d in deltas for part in d.get("tool_calls", ()) if "id" in part]
    arguments = {part["index"]: "" for part in calls}
    for d in deltas:
        for part in d.get("tool_calls", ()):
            arguments[part["index"]] = arguments.get(part["index"], "") + part["function"].get("arguments", "")
    if content:
        message["content"] = content
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": part["id"], "function": {"name": part["function"]["name"],
                                                                  "arguments": arguments[part["index"]]}}
                                 for part in calls]
    return message


def _ollama_message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"function": {"name": call["function"]["name"],
                                           "arguments": _object_or_text(call["function"]["arguments"])}}
                             for call in message["tool_calls"]]
    return out


def _object_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _timings(job: Job) -> dict[str, int]:
    """Ollama's durations, in nanoseconds: all of it, the prompt (to the first token) and the generation."""
    end = job.finished_s or time.perf_counter()
    first = job.first_token_s or end
    return {"total_duration": _ns(end - job.arrival_s), "load_duration": 0,
            "prompt_eval_count": job.prompt_tokens, "prompt_eval_duration": _ns(first - job.arrival_s),
            "eval_count": job.completion_tokens, "eval_duration": _ns(end - first)}


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# --- reading the request ------------------------------------------------------------------------


def _refuse_unknown(body: dict[str, Any], endpoint: str) -> None:
    known = _FIELDS[endpoint]
    for name, value in body.items():
        if name not in known:
            raise bad_request(f"'{name}' is not supported by this server's /api/{endpoint}; leave it out.")
        if known[name] and value not in known[name]:
            raise bad_request(f"'{name}' is not supported by this server; leave it out.")


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object.")
        if message.get("images"):
            raise bad_request(f"messages[{index}] has images; this model takes text only.")
        converted = {key: value for key, value in message.items() if key not in ("images", "thinking", "tool_name")}
        if message.get("role") == "tool" and isinstance(message.get("tool_name"), str):
            converted["name"] = message["tool_name"]
        out.append(converted)
    return out


def _format(value: Any) -> Any:
    if value in (None, ""):
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise bad_request("'format' must be \"json\" or a JSON schema object.")


def _options(options: Any, max_model_len: int) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad_request("'options' must be an object.")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise bad_request(f"option '{unknown[0]}' is not supported by this server (it takes "
                          f"{', '.join(_OPTIONS)}); leave it out.")
    fields = {_OPTIONS[name]: value for name, value in options.items()}
    if fields.get("max_tokens") in (-1, -2):  # no limit / fill the context: the context is the limit
        fields["max_tokens"] = max_model_len
    return fields
