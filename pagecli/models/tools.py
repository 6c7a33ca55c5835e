"""A request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and what they ask of the
prompt and of decoding.

- `auto`: the tools go to the chat template (as transformers passes them) and the reply is parsed for
  calls in the template's format (tool_calls.py).
- `none`: no call is ever returned. The tools are left out of the prompt too, so the model is not asked
  for a call it may not make (the conversation's earlier calls and results stay in it); the reply is
  not parsed.
- `required` or a named function: the reply is constrained by a JSON schema to a list of calls
  (`[{"name": ..., "arguments": {...}}]`, one call where `parallel_tool_calls` is false or a function
  is named), each call's arguments following that function's `parameters` schema.

A template that does not use `tools` gets them described in the system message instead, asking for
`<tool_call>` blocks, so a model with a plain chat template can still be offered tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagecli.config.structured import StructuredSpec
from pagecli.errors import RequestError

AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # OpenAI's {"type": "function", "function": {...}} objects, as sent
    choice: str  # auto, none, required, or "function" (a named one: `forced`)
    forced: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def constrained(self) -> bool:
        """Whether the reply must be calls (the grammar makes it one)."""
        return self.choice in (REQUIRED, "function")

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != NONE

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is given (None: the prompt names no tools)."""
        return list(self.tools) if self.tools and self.choice != NONE else None


def read_tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tool fields checked, or None where it offers no tools; RequestError names a mistake."""
    tools = _tools(body.get("tools"))
    choice, forced = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be true or false")
    if not tools:
        return None
    return ToolRequest(tuple(tools), choice, forced, True if parallel is None else parallel)


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function "
                               "tools are supported)")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function needs a non-empty string 'name'")
        if name in names:
            raise RequestError(f"{where}: two tools are named '{name}'")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object")
    return value


def _choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return AUTO, None
    if value in (AUTO, NONE, REQUIRED):
        if value == REQUIRED and not tools:
            raise RequestError("'tool_choice' is \"required\" but the request has no 'tools'")
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        known = [tool["function"]["name"] for tool in tools]
        if not isinstance(name, str) or name not in known:
            raise RequestError(f"'tool_choice' names the function {json.dumps(name)}, which is not in 'tools'")
        return "function", name
    raise RequestError("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}")


# --- what the request asks of decoding ----------------------------------------------------------------


def calls_schema(request: ToolRequest) -> dict[str, Any]:
    """The JSON schema a constrained reply follows: a list of calls to the allowed functions."""
    allowed = [tool["function"] for tool in request.tools
               if request.forced is None or tool["function"]["name"] == request.forced]
    variants = [_call_schema(function) for function in allowed]
    item = variants[0] if len(variants) == 1 else {"anyOf": variants}
    single = request.forced is not None or not request.parallel
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


# --- templates that do not take tools -----------------------------------------------------------------


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def tools_in_system_message(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools described in its system message (added first where it has none),
    for a chat template that ignores `tools`."""
    described = _tools_text(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{described}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def _tools_text(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You can call these functions (JSON schemas):\n<tools>\n" + listed + "\n</tools>\n\n"
            "To call one, reply with a JSON object with its name and arguments inside <tool_call></tool_call> "
            "tags, one per call:\n<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"arg\": \"value\"}}\n"
            "</tool_call>")


def calls_constraint(request: ToolRequest, has_response_format: bool) -> StructuredSpec | None:
    """The grammar of a reply that must be calls ("required" or a named function), else None; the serve and
    generate paths both ask here. RequestError where the request also sets its own response_format."""
    if not request.constrained:
        return None
    if has_response_format:
        raise RequestError("'response_format' cannot be combined with 'tool_choice' \"required\" or a named "
                           "function: the reply is already constrained to tool calls")
    return StructuredSpec.json_schema(calls_schema(request))
