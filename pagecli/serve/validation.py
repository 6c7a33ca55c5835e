"""A request body made into what the engine runs: the prompt, the sampling settings, n, streaming.

Sampling fields are read by `pagecli.batch.requests` (the same checks `generate` makes) and messages by
`pagecli.models.messages`. Fields the server cannot honour are refused with a 400 naming them, never
ignored silently; fields that change nothing about the output (`user`, `metadata`, ...) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pagecli.batch.requests import sampling_fields, sampling_with
from pagecli.config import SamplingParams
from pagecli.errors import PagecliError, request_failure
from pagecli.models.messages import Conversation, read_messages
from pagecli.models.tools import ToolRequest, calls_constraint, read_tool_request
from pagecli.serve.errors import ApiError, bad_request

MAX_N = 64  # candidates per request: each one is a running sequence
Prompt = str | list[dict[str, Any]] | list[int] | Conversation

# Each field and the values of it that ask for nothing pagecli lacks; any other value is refused.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "suffix": (None, ""), "best_of": (None, 1), "audio": (None,), "modalities": (None, ["text"]),
    "beam_width": (None, 1), "length_penalty": (None, 1, 1.0), "early_stopping": (None, False),  # beams: generate only
    "prediction": (None,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),  # the model's own template only
}


@dataclass(frozen=True)
class ApiRequest:
    """One /v1/chat/completions or /v1/completions request, checked."""

    kind: str  # "chat" or "completion"
    model: str | None
    prompt: Prompt
    sampling: SamplingParams  # n included: the engine forks the n candidates (candidate i: seed + i)
    n: int
    stream: bool
    include_usage: bool
    tools: ToolRequest | None = None  # chat only: the request's tools and tool_choice


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON ({exc}).", "invalid_json") from None
    except (RecursionError, ValueError) as exc:
        raise bad_request(f"The request body is not valid JSON ({type(exc).__name__}).", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, not {type(body).__name__}.", "invalid_json")
    return body


def parse_request(body: dict[str, Any], kind: str, base: SamplingParams) -> ApiRequest:
    """The checked request; any mistake in it raises ApiError (400) naming the field."""
    _refuse_unsupported(body)
    prompt = _with_request_errors(lambda: _chat_prompt(body) if kind == "chat" else _completion_prompt(body))
    sampling = _with_request_errors(lambda: sampling_with(base, sampling_fields(body)))
    n = _n(body.get("n"))
    if sampling.seed is not None and sampling.seed + n - 1 >= 1 << 64:
        raise bad_request("'seed' + n - 1 must fit in 64 bits (candidate i samples with seed + i).", param="seed")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", param="model")
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    include_usage = _flag(options, "include_usage")
    tools = _with_request_errors(lambda: read_tool_request(body)) if kind == "chat" else None
    if tools is not None:
        prompt = Conversation(prompt, tools.template_tools())
        sampling = _calls_constrained(sampling, tools)
    return ApiRequest(kind, model, prompt, replace(sampling, n=n), n, stream, include_usage, tools)


def _calls_constrained(sampling: SamplingParams, tools: ToolRequest) -> SamplingParams:
    """tool_choice "required" or a named function: the reply constrained to calls by a JSON schema."""
    spec = _with_request_errors(lambda: calls_constraint(tools, sampling.structured is not None))
    return sampling if spec is None else replace(sampling, structured=spec)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, harmless in _UNSUPPORTED.items():
        if name in body and body[name] not in harmless:
            raise bad_request(f"'{name}' is not supported by this server; leave it out.", "unsupported_parameter",
                              param=name)


def _with_request_errors(read: Any) -> Any:
    try:
        return read()
    except PagecliError as exc:
        raise bad_request(_sentence(str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - request_failure sorts the request's fault from a bug
        message = request_failure(exc)
        if message is None:
            raise
        raise bad_request(_sentence(message)) from None


def _sentence(message: str) -> str:
    return message if message.endswith(".") else message + "."


def _chat_prompt(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" not in body:
        raise ApiError(400, "A chat completion needs 'messages'.", "missing_required_parameter", param="messages")
    return read_messages(body["messages"])


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request).",
                   "invalid_value", param="prompt")


def _n(value: Any) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_N:
        raise bad_request(f"'n' must be an integer from 1 to {MAX_N}.", param="n")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false.", param=name)
    return value
