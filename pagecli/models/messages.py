"""Chat messages as clients send them, made into what a chat template takes.

OpenAI's API, its batch files and most SDKs send `content` either as a string or as a list of
parts (`{"type": "text", "text": ...}`); newer clients send the `developer` role for what older
ones call `system`. `generate`, `chat` and the server all read messages through `read_messages`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagecli.errors import RequestError

TEXT_PART_TYPES = ("text", "input_text")


def read_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` checked and flattened: every message a dict with a string role and string content.

    Text parts are joined in order with newlines; any other part (an image, audio) is refused with a
    message saying the model takes text only. An assistant message may have no content (None), as
    OpenAI's API allows next to tool calls; it becomes an empty string.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise RequestError(f"message {index + 1} needs a string 'role' (and 'content')")
        content = _content_text(message.get("content"), index, message["role"])
        out.append(_checked_tool_fields({**message, "content": content}, index))
    return out


@dataclass(frozen=True)
class Conversation:
    """Chat messages with the tools the chat template is told about (OpenAI's `tools` objects)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def _checked_tool_fields(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A `tool` message's `tool_call_id` and an assistant's `tool_calls` checked; each call's `arguments`
    (a JSON string, as OpenAI sends them) becomes an object, as chat templates expect to render it."""
    where = f"message {index + 1}"
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id", ""), str):
        raise RequestError(f"{where}: 'tool_call_id' must be a string")
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise RequestError(f"{where}: 'tool_calls' must be a list, on an assistant message")
    return {**message, "tool_calls": [_checked_call(call, f"{where}, tool call {n + 1}") for n, call in enumerate(calls)]}


def _checked_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RequestError(f"{where}: needs 'function' with a string 'name'")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"{where}: 'function.arguments' is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}: 'function.arguments' must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def _content_text(content: Any, index: int, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise RequestError(f"message {index + 1}: 'content' must be a string or a list of content parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(kind, str) and kind not in TEXT_PART_TYPES:
            raise RequestError(f"message {index + 1} has a '{kind}' part; this model takes text only")
        else:
            raise RequestError(f"message {index + 1}: each content part needs a 'type' and, for text, a string "
                               "'text'")
    return "\n".join(texts)


def developer_as_system(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """The `developer` role renamed `system` where the chat template does not know it."""
    if template and "developer" in template:
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
