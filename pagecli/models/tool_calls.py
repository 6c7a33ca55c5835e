"""Tool calls in a model's reply: which format the chat template teaches (from the markers its text
holds), the reply split into content and calls, and the same split made while the reply streams.

Formats: `<tool_call>{json}</tool_call>` blocks (Qwen, Hermes, SmolLM3 and most ChatML templates),
Llama 3.x JSON calls (`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`, several
separated by `;`) and Mistral's `[TOOL_CALLS][{...}, ...]`. pagecli's detokenizer drops special tokens,
so `<|python_tag|>` and `[TOOL_CALLS]` (special in those vocabularies) may be missing from the text:
a reply that starts with the call's JSON counts as a call as well.

Invariant: nothing the model wrote is lost. A call that does not parse stays in `content` word for
word; the streamed content is always a prefix of the whole reply's content, so a stream reassembles
to exactly what the non-streaming answer holds.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_HERMES_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends `function.arguments`
    call_id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply less its calls ("" when it held only calls)
    tool_calls: tuple[ToolCall, ...] = ()


def tool_format_of(template: str | None) -> str:
    """The call format a chat template teaches, from the markers in its text; `<tool_call>` blocks for a
    template that names none (pagecli then describes the tools itself in that format: see tools.py)."""
    text = template or ""
    if _MISTRAL_MARK in text:
        return MISTRAL
    if _OPEN in text:
        return HERMES
    if _PYTHON_TAG in text or '"parameters": ' in text:
        return LLAMA3_JSON
    return HERMES


def new_call_id(fmt: str) -> str:
    """`call_<random>`; Mistral's templates refuse any id but 9 letters and digits."""
    if fmt == MISTRAL:
        return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def parse_reply(text: str, fmt: str) -> ParsedReply:
    """The reply's content and calls; text that looks like a call but does not parse stays content."""
    if fmt == HERMES:
        return _parse_hermes(text)
    if fmt == LLAMA3_JSON:
        return _parse_llama3(text)
    if fmt == MISTRAL:
        return _parse_mistral(text)
    raise ValueError(f"unknown tool call format {fmt!r}")


def call_from_object(obj: Any, fmt: str) -> ToolCall | None:
    """A call from its JSON object (`name` and `arguments`, or `parameters` as Llama writes them), or
    None where the object is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = set(obj) - {"name", "id", "type"}
    if len(keys) > 1 or not keys <= {"arguments", "parameters"}:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_call_id(fmt))


# --- whole replies ------------------------------------------------------------------------------------


def _parse_hermes(text: str) -> ParsedReply:
    pieces, calls, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        call = call_from_object(_json_or_none(match.group(1).strip()), HERMES)
        if call is None:
            continue  # left in the content as written
        pieces.append(text[last:match.start()])
        calls.append(call)
        last = match.end()
    if not calls:
        return ParsedReply(text)
    pieces.append(text[last:])
    return ParsedReply(_join_around_calls(pieces), tuple(calls))


def _join_around_calls(pieces: list[str]) -> str:
    """The text between calls: the whitespace that set the calls apart goes with them."""
    kept = [piece.strip() for piece in pieces]
    kept[0] = pieces[0].rstrip()
    return "\n".join(piece for piece in kept if piece)


def _parse_llama3(text: str) -> ParsedReply:
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return ParsedReply(text)
    calls = _json_sequence(body, LLAMA3_JSON)
    return ParsedReply("", tuple(calls)) if calls else ParsedReply(text)


def _json_sequence(body: str, fmt: str) -> list[ToolCall]:
    """Calls written as JSON objects one after another (separated by `;`, `,` or whitespace); [] unless
    the whole of `body` is such calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        call = call_from_object(obj, fmt)
        if call is None:
            return []
        calls.append(call)
        at = _skip_separators(body, at)
    return calls


def _skip_separators(body: str, at: int) -> int:
    while at < len(body) and (body[at].isspace() or body[at] in ";,"):
        at += 1
    return at


def _parse_mistral(text: str) -> ParsedReply:
    mark = text.find(_MISTRAL_MARK)
    if mark >= 0:
        before, body = text[:mark], text[mark + len(_MISTRAL_MARK):].strip()
    elif text.lstrip().startswith("["):
        before, body = "", text.strip()
    else:
        return ParsedReply(text)
    calls = _call_list(body, MISTRAL)
    return ParsedReply(before.rstrip(), tuple(calls)) if calls else ParsedReply(text)


def parse_call_list(text: str, fmt: str) -> ParsedReply:
    """A reply constrained to a JSON list of calls (tool_choice "required" or a named function)."""
    calls = _call_list(text.strip(), fmt)
    return ParsedReply("", tuple(calls)) if calls else ParsedReply(text)


def _call_list(body: str, fmt: str) -> list[ToolCall]:
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return []
    if body[end:].strip():
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_object(item, fmt) for item in items]
    return calls if calls and all(c is not None for c in calls) else []  # type: ignore[return-value]


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# --- streaming ---------------------------------------------------------------------------------------


class ToolCallStream:
    """The split made as the reply streams: content goes out as soon as it cannot be the start of a
    call; from the first possible call on, the text is held and parsed whole when the reply ends.

    Held back: trailing whitespace (it is dropped before a call) and any tail that could still become a
    call marker. `finish()` returns the rest of the content and the calls of `parse_reply(whole text)`.
    """

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a call may have started: everything from here waits for the end

    def feed(self, delta: str) -> str:
        """The content that can go out now."""
        self.text += delta
        if self.holding:
            return ""
        end, self.holding = self._content_end()
        # text[:sent] ends in a non-space (or is empty), so only the unsent part needs trimming
        end = self.sent + len(self.text[self.sent:end].rstrip()) if end > self.sent else end
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The content not yet sent and the reply's calls."""
        parsed = parse_reply(self.text, self.fmt)
        sent = self.text[:self.sent]
        if not parsed.content.startswith(sent):  # cannot happen (see the module's invariant); never lose text
            return self.text[self.sent:], ()
        return parsed.content[len(sent):], parsed.tool_calls

    def _content_end(self) -> tuple[int, bool]:
        """How much of the text so far is surely content, and whether a call has surely begun there."""
        if self.fmt == LLAMA3_JSON:
            if self.sent:
                return len(self.text), False  # the reply did not start with a call: it has none
            stripped = self.text.lstrip()
            if stripped.startswith(("{", _PYTHON_TAG)):
                return 0, True
            return (0, False) if _PYTHON_TAG.startswith(stripped) else (len(self.text), False)
        marker = _OPEN if self.fmt == HERMES else _MISTRAL_MARK
        found = self.text.find(marker, max(0, self.sent - len(marker)))
        if found >= 0:
            return found, True
        if self.fmt == MISTRAL and self.sent == 0:
            stripped = self.text.lstrip()
            if not stripped or stripped.startswith("["):
                return 0, bool(stripped)
        return len(self.text) - _marker_prefix_len(self.text, (marker,)), False


def _marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that a marker starts with (it may yet become that marker)."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                best = max(best, size)
                break
    return best
