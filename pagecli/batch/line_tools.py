"""Tools in `generate`'s input lines, as in `pagecli serve`: a line's `tools`, `tool_choice` and
`parallel_tool_calls` give the chat template its tools (and, for "required" or a named function, the
reply its grammar), and the line's record gets the reply's calls.

A record of a line with tools keeps `text` (the reply as written) and, where the reply held calls, adds
`tool_calls` (OpenAI's objects) and `content` (the text less its calls, null when none is left), with
`finish_reason` "tool_calls".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagecli.errors import RequestError
from pagecli.models.messages import Conversation
from pagecli.models.tool_calls import parse_call_list, parse_reply, tool_format_of
from pagecli.models.tools import ToolRequest, calls_constraint, read_tool_request

RecordFields = Callable[[str, str | None], dict[str, Any]]  # (text, finish_reason) -> fields to add


def tools_of_line(body: dict[str, Any], prompt: Any) -> tuple[Any, ToolRequest | None, dict[str, Any]]:
    """The line's prompt with its tools, its tool request, and the sampling fields it adds (the grammar
    of a forced call); RequestError names a mistake."""
    tools = read_tool_request(body)
    if tools is None:
        return prompt, None, {}
    if isinstance(prompt, str):
        raise RequestError("'tools' need a 'messages' conversation, not a 'prompt'")
    spec = calls_constraint(tools, body.get("response_format") is not None)
    return Conversation(prompt, tools.template_tools()), tools, {} if spec is None else {"structured": spec}


def record_fields(tools: ToolRequest | None, chat_template: str | None) -> RecordFields | None:
    """What a finished reply adds to its record: its calls (None for a line without tools to read)."""
    if tools is None or not tools.parses_calls:
        return None
    fmt = tool_format_of(chat_template)

    def fields(text: str, finish_reason: str | None) -> dict[str, Any]:
        parsed = parse_call_list(text, fmt) if tools.constrained else parse_reply(text, fmt)
        if not parsed.tool_calls:
            return {}
        return {"content": parsed.content or None, "tool_calls": [call.as_openai() for call in parsed.tool_calls],
                "finish_reason": "tool_calls" if finish_reason == "stop" else finish_reason}

    return fields
