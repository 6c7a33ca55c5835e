"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) as a translation over the common
request path: `input` items, `instructions`, `text.format`, function `tools` and `previous_response_id`
become a chat request (validation.py checks it as it checks Chat Completions); the reply's deltas become
output items and the typed stream events (response.created ... response.completed).

A stored response keeps its conversation (response_store.py), so a continued one is the same prompt plus
the new input: its prefix comes from the prefix cache and usage.input_tokens_details.cached_tokens says so.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagecli.serve import sse
from pagecli.serve.chat_output import ReplyRules, message_deltas
from pagecli.serve.errors import ApiError, bad_request, renamed
from pagecli.serve.jobs import Job
from pagecli.serve.request_path import RequestPath, reply_pieces, reply_rules, whole_reply
from pagecli.serve.validation import ApiRequest, parse_request

# Fields read here, and fields accepted with the values that ask for nothing this server lacks.
_READ = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools",
         "tool_choice", "parallel_tool_calls", "previous_response_id", "store",
         "seed", "top_k"}  # the last two: pagecli's own, as in its Chat Completions
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "metadata": (), "user": (), "safety_identifier": (), "prompt_cache_key": (), "stream_options": (),
    "service_tier": (None, "auto", "default"), "truncation": (None, "disabled"), "background": (None, False),
    "include": (None, []), "top_logprobs": (None, 0), "max_tool_calls": (None,), "reasoning": (None, {}),
    "prompt_cache_retention": (None, "in_memory"),
}  # an empty tuple: any value (it changes nothing about the output)
_CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def routes(state: Any, path: RequestPath) -> list[Route]:
    async def create(request: Request) -> Response:
        return await path.answer(request, ResponsesApi(state))

    async def retrieve(request: Request) -> Response:
        endpoint = "/v1/responses/{response_id}"
        try:
            path.authorize(request)
            stored = state.stored.get(request.path_params["response_id"])
            if stored is None:
                raise _not_found(request.path_params["response_id"], param=None)
        except ApiError as error:
            return path.refused(request.url.path, error, method="GET", endpoint=endpoint)
        path.answered(request.url.path, 200, None, method="GET", endpoint=endpoint)
        return JSONResponse(stored.body)

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"])]


class ResponsesApi:
    media_type = sse.MEDIA_TYPE

    def __init__(self, state: Any) -> None:
        self.s = state
        self.body: dict[str, Any] = {}
        self.conversation: list[dict[str, Any]] = []  # without the instructions, as stored
        self.request: ApiRequest | None = None
        self.rules = ReplyRules()

    # --- the request ----------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> ApiRequest:
        _refuse_unknown(body)
        self.body = body
        previous = _string_or_none(body, "previous_response_id")
        history: list[dict[str, Any]] = []
        if previous is not None:
            stored = self.s.stored.get(previous)
            if stored is None:
                raise _not_found(previous, "previous_response_id")
            history = list(stored.messages)
        self.conversation = history + input_messages(body.get("input"))
        instructions = _string_or_none(body, "instructions")
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "top_k": body.get("top_k"), "seed": body.get("seed"),
                "max_tokens": _max_output_tokens(body.get("max_output_tokens")),
                "parallel_tool_calls": body.get("parallel_tool_calls"),
                "response_format": _response_format(body.get("text")),
                "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice"))}
        try:
            self.request = parse_request({k: v for k, v in chat.items() if v is not None}, "chat", self.s.sampling)
        except ApiError as error:
            raise renamed(error, _CHAT_NAMES) from None
        self.rules = reply_rules(self.s, self.request)
        return self.request

    def error_response(self, error: ApiError) -> Response:
        return error.response()

    # --- the reply ------------------------------------------------------------------------------
    async def complete(self, job: Job) -> Response:
        reply = await whole_reply(job, self.rules)
        output = _Output()
        output.feed(message_deltas(reply.message))
        output.close()
        return JSONResponse(self._finished(job, output, reply.finish_reason))

    async def stream(self, job: Job) -> AsyncIterator[bytes]:
        output, head = _Output(), self._response(job, "in_progress", [])
        yield output.event("response.created", response=head)
        yield output.event("response.in_progress", response=head)
        reason = "stop"
        async for pieces in reply_pieces(job, self.rules):
            for piece in pieces:
                output.feed(piece.deltas)
                reason = piece.finish_reason or reason
            yield output.take_events()
        output.close()
        yield output.take_events()
        body = self._finished(job, output, reason)
        yield output.event("response.completed" if body["status"] == "completed" else "response.incomplete",
                           response=body)

    def stream_error(self, error: ApiError) -> bytes:
        payload = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()

    def _finished(self, job: Job, output: _Output, finish_reason: str) -> dict[str, Any]:
        status = "incomplete" if finish_reason == "length" else "completed"
        body = self._response(job, status, output.items)
        body["usage"] = {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": job.cached_tokens},
                         "output_tokens": job.completion_tokens,
                         "output_tokens_details": {"reasoning_tokens": job.reasoning_tokens},
                         "total_tokens": job.prompt_tokens + job.completion_tokens}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.body.get("store", True) is not False:
            self.s.stored.put(body["id"], self.conversation + output.as_messages(), body)
        return body

    def _response(self, job: Job, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        text = body.get("text") or {"format": {"type": "text"}}
        return {
            "id": f"resp_{job.job_id}", "object": "response", "created_at": int(job_created_s(job)),
            "status": status, "model": body.get("model") or self.s.model_ids[0], "output": output,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "error": None, "incomplete_details": None,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "text": text,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "metadata": body.get("metadata") or {}, "store": body.get("store", True), "usage": None,
        }


def job_created_s(job: Job) -> float:
    """The job's arrival as seconds since the epoch (its clock is perf_counter)."""
    return time.time() - (time.perf_counter() - job.arrival_s)


class _Output:
    """The response's output items built from the reply's deltas, with the stream events that say so.

    Items open and close in the order the reply makes them: reasoning, a message with one output_text part,
    function calls. The whole reply is built by the same feed, so streamed and not agree item for item."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._events: list[bytes] = []
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def take_events(self) -> bytes:
        out, self._events = b"".join(self._events), []
        return out

    def _emit(self, kind: str, **fields: Any) -> None:
        self._events.append(self.event(kind, **fields))

    def feed(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            if delta.get("reasoning_content"):
                self._add_reasoning(delta["reasoning_content"])
            if delta.get("content"):
                self._add_text(delta["content"])
            for part in delta.get("tool_calls", ()):
                self._add_call_part(part)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}  # type: ignore[index]

    def _start(self, item: dict[str, Any]) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_in_progress(item))

    def _add_reasoning(self, text: str) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._start({"type": "reasoning", "id": _id("rs"), "summary": [],
                         "content": [{"type": "reasoning_text", "text": ""}]})
        self._open["content"][0]["text"] += text  # type: ignore[index]
        self._emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def _add_text(self, text: str) -> None:
        if self._open is None or self._open["type"] != "message":
            self._start({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                         "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"].append(part)  # type: ignore[index]
            self._emit("response.content_part.added", **self._where(), content_index=0, part=dict(part))
        self._open["content"][0]["text"] += text  # type: ignore[index]
        self._emit("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])

    def _add_call_part(self, part: dict[str, Any]) -> None:
        if "id" in part:  # a call's head: a new item
            self._start({"type": "function_call", "id": _id("fc"), "call_id": part["id"],
                         "name": part["function"]["name"], "arguments": "", "status": "completed"})
        arguments = part["function"].get("arguments", "")
        if arguments:
            self._open["arguments"] += arguments  # type: ignore[index]
            self._emit("response.function_call_arguments.delta", **self._where(), delta=arguments)

    def close(self) -> None:
        """End the open item: its done events."""
        item, self._open = self._open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self._emit("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            self._emit("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=where["output_index"], item=item)

    def as_messages(self) -> list[dict[str, Any]]:
        """The reply as chat messages, for the conversation a later request continues."""
        text = "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]


def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
    started = {**item, "status": "in_progress"} if "status" in item else dict(item)
    if item["type"] == "message":
        started["content"] = []
    return started


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --- reading the request ------------------------------------------------------------------------


def _refuse_unknown(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _READ:
            continue
        harmless = _HARMLESS.get(name)
        if harmless is None:
            raise bad_request(f"'{name}' is not supported by this server's Responses API; leave it out.",
                              "unsupported_parameter", param=name)
        if harmless and value not in harmless:
            raise bad_request(f"'{name}' = {json.dumps(value)} is not supported by this server; leave it out "
                              f"or send {json.dumps(harmless[-1])}.", "unsupported_parameter", param=name)


def _string_or_none(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string.", param=name)
    return value


def _not_found(response_id: str, param: str | None) -> ApiError:
    return ApiError(404, f"No stored response has the id '{response_id}' (responses are kept in memory for a "
                         "limited time and number, and not across restarts).", "previous_response_not_found",
                    param=param)


def _max_output_tokens(value: Any) -> Any:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise bad_request("'max_output_tokens' must be a positive integer.", param="max_output_tokens")
    return value


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of message, function_call and function_call_output items) as chat
    messages: function calls join the assistant message before them, outputs become tool messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a non-empty string or a non-empty list of input items.", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": _role(item, where), "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            if not (messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]):
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
            messages[-1]["tool_calls"].append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates leave it out of past turns too
        else:
            raise bad_request(f"{where} is a '{kind}' item; this server takes message, function_call, "
                              "function_call_output and reasoning items.", param="input")
    return messages


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer.", param="input")
    return role


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where} needs a string '{name}'.", param="input")
    return value


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts.", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("refusal",) and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise bad_request(f"{where} has a {json.dumps(kind)} content part; this model takes text only "
                              "(input_text / output_text parts).", param="input")
    return "\n".join(texts)


def _response_format(text: Any) -> Any:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object such as {\"format\": {\"type\": \"text\"}}.", param="text")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise bad_request(f"'text.{sorted(unknown)[0]}' is not supported; leave it out.", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' other than \"medium\" is not supported; leave it out.", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format.type' must be text, json_object or json_schema.", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _tools(tools: Any) -> Any:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools.", param="tools")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{index}] is a {json.dumps(kind)} tool; this server runs function tools only.",
                              "unsupported_tool", param="tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
