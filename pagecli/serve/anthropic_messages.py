"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) as a translation over the
common request path: `system`, content blocks (text, tool_use, tool_result), `tools` with `tool_choice`
(auto, any, tool, none) and `stop_sequences` become a chat request that validation.py checks; the reply
becomes content blocks, Anthropic's stop reasons and usage (cache reads apart from input tokens), streamed
as message_start, content_block_start/delta/stop, message_delta and message_stop. Errors take Anthropic's
shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagecli.serve import sse
from pagecli.serve.chat_output import ReplyRules, message_deltas
from pagecli.serve.errors import ApiError, bad_request, renamed
from pagecli.serve.jobs import Accepted, Job, Rejected, Sink
from pagecli.serve.request_path import CLIENT_CLOSED, RequestPath, read_body, reply_pieces, reply_rules, whole_reply
from pagecli.serve.validation import ApiRequest, parse_json, parse_request

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}
_READ = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
         "tools", "tool_choice", "output_config"}
_HARMLESS: dict[str, tuple[Any, ...]] = {  # an empty tuple: any value (it changes nothing about the output)
    "metadata": (), "service_tier": (None, "auto", "standard_only"), "thinking": (None, {"type": "disabled"}),
    "cache_control": (),  # prefix caching is automatic here: every prompt's full blocks are cached
    "inference_geo": (), "user_profile_id": (), "workspace_id": (), "speed": (None, "standard"),
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def routes(state: Any, path: RequestPath) -> list[Route]:
    async def create(request: Request) -> Response:
        return await path.answer(request, MessagesApi(state))

    async def count_tokens(request: Request) -> Response:
        api = MessagesApi(state, counting=True)
        try:
            path.authorize(request)
            api_request = api.parse(parse_json(await read_body(request)))
            path.check_model(api_request.model)
            job = Job("count", api_request.prompt, api_request.sampling, Sink(asyncio.get_running_loop()))
            state.engine_thread.count_tokens(job)
            message = await job.sink.get()
            if isinstance(message, Rejected):
                raise message.error
            assert isinstance(message, Accepted)
        except ApiError as error:
            return path.refused(request.url.path, error, api)
        except ClientDisconnect:
            path.answered(request.url.path, CLIENT_CLOSED, None, "the client left while sending the request")
            return Response(status_code=CLIENT_CLOSED)
        path.answered(request.url.path, 200, None)
        return JSONResponse({"input_tokens": message.prompt_tokens})

    return [Route("/v1/messages", create, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


def error_response(error: ApiError) -> Response:
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": error.message}},
                        status_code=error.status, headers=error.headers)


class MessagesApi:
    media_type = sse.MEDIA_TYPE

    def __init__(self, state: Any, counting: bool = False) -> None:
        self.s = state
        self.counting = counting  # count_tokens: no max_tokens needed
        self.body: dict[str, Any] = {}
        self.rules = ReplyRules()
        self.stop_sequences: tuple[str, ...] = ()

    # --- the request ----------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> ApiRequest:
        _refuse_unknown(body, self.counting)
        self.body = body
        if not self.counting and "max_tokens" not in body:
            raise bad_request("'max_tokens' is required.", param="max_tokens")
        model = body.get("model")
        if not self.counting and not isinstance(model, str):
            raise bad_request("'model' is required (a string).", param="model")
        stops = body.get("stop_sequences")
        if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise bad_request("'stop_sequences' must be a list of non-empty strings.", param="stop_sequences")
        self.stop_sequences = tuple(stops or ())
        chat = {"model": model, "messages": _system(body.get("system")) + chat_messages(body.get("messages")),
                "stream": body.get("stream"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "top_k": body.get("top_k"), "max_tokens": None if self.counting else body["max_tokens"],
                "stop": list(self.stop_sequences) or None, "response_format": _output_format(body.get("output_config")),
                **_tools(body.get("tools"), body.get("tool_choice"))}
        try:
            request = parse_request({k: v for k, v in chat.items() if v is not None}, "chat", self.s.sampling)
        except ApiError as error:
            raise renamed(error, {"stop": "stop_sequences", "response_format": "output_config.format"}) from None
        self.rules = reply_rules(self.s, request)
        return request

    def error_response(self, error: ApiError) -> Response:
        return error_response(error)

    # --- the reply ------------------------------------------------------------------------------
    async def complete(self, job: Job) -> Response:
        reply = await whole_reply(job, self.rules)
        blocks = _Blocks()
        blocks.feed(message_deltas(reply.message))
        blocks.close()
        reason, stop_sequence = self._stop(reply.finish_reason, reply.token_ids)
        body = {**self._head(job), "content": blocks.blocks, "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": _usage(job)}
        return JSONResponse(body)

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        blocks = _Blocks()
        start = {**self._head(job), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**_usage(job), "output_tokens": 0}}
        yield _event("message_start", {"type": "message_start", "message": start})
        yield _event("ping", {"type": "ping"})
        reason, token_ids = "stop", []
        async for pieces in reply_pieces(job, self.rules):
            for piece in pieces:
                blocks.feed(piece.deltas)
                token_ids += piece.token_ids
                reason = piece.finish_reason or reason
            yield blocks.take_events()
        blocks.close()
        yield blocks.take_events()
        stop_reason, stop_sequence = self._stop(reason, tuple(token_ids))
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                       "usage": {"output_tokens": job.completion_tokens}})
        yield _event("message_stop", {"type": "message_stop"})

    def stream_error(self, error: ApiError) -> bytes:
        return _event("error", json.loads(error_response(error).body))

    def _head(self, job: Job) -> dict[str, Any]:
        return {"id": f"msg_{job.job_id}", "type": "message", "role": "assistant",
                "model": self.body.get("model") or self.s.model_ids[0]}

    def _stop(self, finish_reason: str, token_ids: tuple[int, ...]) -> tuple[str, str | None]:
        """Anthropic's stop reason, and the stop sequence that ended the reply where one did."""
        engine = self.s.engine_thread.engine
        ended_by_text = finish_reason == "stop" and self.stop_sequences and token_ids and \
            token_ids[-1] not in getattr(engine, "stop_token_ids", ())
        if not ended_by_text:
            return _STOP_REASONS.get(finish_reason, "end_turn"), None
        if len(self.stop_sequences) == 1:
            return "stop_sequence", self.stop_sequences[0]
        # The reply as the engine saw it before cutting it at the stop. Decoding reads the tokenizer's immutable
        # vocabulary only (tokenizers' Rust Tokenizer), nothing the engine thread changes.
        text = engine.tokenizer.decode(list(token_ids))
        found = [(text.find(s), s) for s in self.stop_sequences if s in text]
        return "stop_sequence", min(found)[1] if found else self.stop_sequences[0]


def _usage(job: Job) -> dict[str, Any]:
    """Anthropic counts input tokens read from the cache apart from the rest of the input."""
    return {"input_tokens": job.prompt_tokens - job.cached_tokens, "cache_read_input_tokens": job.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": job.completion_tokens}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class _Blocks:
    """The reply's content blocks (thinking, text, tool_use) built from its deltas, with their stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._arguments = ""  # the open tool_use block's input, as JSON text so far
        self._events: list[bytes] = []

    def take_events(self) -> bytes:
        out, self._events = b"".join(self._events), []
        return out

    def _emit(self, name: str, **fields: Any) -> None:
        self._events.append(_event(name, {"type": name, **fields}))

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.blocks.append(block)
        self._open = block
        self._emit("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))

    def _delta(self, delta: dict[str, Any]) -> None:
        self._emit("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def feed(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            if delta.get("reasoning_content"):
                if self._open is None or self._open["type"] != "thinking":
                    self._start({"type": "thinking", "thinking": "", "signature": ""})
                self._open["thinking"] += delta["reasoning_content"]  # type: ignore[index]
                self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if self._open is None or self._open["type"] != "text":
                    self._start({"type": "text", "text": ""})
                self._open["text"] += delta["content"]  # type: ignore[index]
                self._delta({"type": "text_delta", "text": delta["content"]})
            for part in delta.get("tool_calls", ()):
                if "id" in part:
                    self._start({"type": "tool_use", "id": part["id"], "name": part["function"]["name"], "input": {}})
                arguments = part["function"].get("arguments", "")
                if arguments:
                    self._arguments += arguments
                    self._delta({"type": "input_json_delta", "partial_json": arguments})

    def close(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if block["type"] == "tool_use":
            block["input"] = _object_or_empty(self._arguments)
            self._arguments = ""
        elif block["type"] == "thinking":
            self._delta({"type": "signature_delta", "signature": ""})
        self._emit("content_block_stop", index=len(self.blocks) - 1)


def _object_or_empty(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- reading the request ------------------------------------------------------------------------


def _refuse_unknown(body: dict[str, Any], counting: bool) -> None:
    for name, value in body.items():
        if name in _READ:
            continue
        harmless = _HARMLESS.get(name)
        if harmless is None:
            raise bad_request(f"'{name}' is not supported by this server's Messages API; leave it out.", param=name)
        if harmless and value not in harmless:
            raise bad_request(f"'{name}' = {json.dumps(value)} is not supported by this server; leave it out.",
                              param=name)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        return [{"role": "system", "content": _text_blocks(system, "system")}]
    raise bad_request("'system' must be a string or a list of text blocks.", param="system")


def _text_blocks(blocks: list[Any], where: str) -> str:
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where} has a {json.dumps(kind)} block where text blocks are expected; this model "
                              "takes text only.", param=where.split("[")[0])
        texts.append(block["text"])
    return "\n".join(texts)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic's user/assistant messages as chat messages: an assistant's tool_use blocks become its
    tool_calls, a user's tool_result blocks become tool messages (before the user's own text)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where} needs 'role' user or assistant.", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks_as_messages(message["role"], content, where)
        else:
            raise bad_request(f"{where}.content must be a string or a list of content blocks.", param="messages")
    return out


def _blocks_as_messages(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(blocks):
        at = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                    not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}: a tool_use block needs a string 'id' and 'name' and an object 'input'.",
                                  param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{at}: a tool_result block needs a string 'tool_use_id'.", param="messages")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_blocks(result, at) if isinstance(result, list) else None
            if text is None:
                raise bad_request(f"{at}: 'content' must be a string or a list of text blocks.", param="messages")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking: chat templates leave it out of past turns too
        else:
            raise bad_request(f"{at} is a {json.dumps(kind)} block, which a {role} message cannot carry here (this "
                              "model takes text, tool_use and tool_result blocks).", param="messages")
    text = "\n".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _output_format(config: Any) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) as OpenAI's response_format; an `effort` is refused."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise bad_request("'output_config' must be an object with 'format' (and no other field here).",
                          param="output_config")
    if config.get("effort") is not None:
        raise bad_request("'output_config.effort' is not supported by this server; leave it out.",
                          param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                          param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """`tools` and `tool_choice` in OpenAI's form (what validation.py reads)."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list of tools.", param="tools")
        functions = []
        for index, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise bad_request(f"tools[{index}] is a {json.dumps(kind)} tool; this server runs client tools only "
                                  "({name, description, input_schema}).", param="tools")
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if "description" in tool:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    if choice is None:
        return out
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}.", param="tool_choice")
    kind = choice["type"]
    out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice.get("name")}}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad_request("'tool_choice.disable_parallel_tool_use' must be true or false.", param="tool_choice")
        out["parallel_tool_calls"] = not parallel
    return out
