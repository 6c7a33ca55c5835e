"""One chat candidate's reply made into what OpenAI's API returns: `reasoning_content` split off where
the model thinks, `tool_calls` parsed out of the content, and the finish reason that says which.

The non-streaming message is built by feeding the whole reply through the same `ReplyStream` a stream
uses, so a streamed reply reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagecli.models.reasoning import ReasoningStream
from pagecli.models.tool_calls import ToolCall, ToolCallStream, parse_call_list


@dataclass(frozen=True)
class ReplyRules:
    """How a job's replies are read."""

    reasoning: bool = False  # split <think>...</think> into reasoning_content
    thinking_at_start: bool = False  # the prompt already opened <think>
    tool_format: str | None = None  # parse calls in this format (None: the reply is all content)
    calls_only: bool = False  # the grammar made the reply a JSON list of calls (tool_choice required/named)

    @property
    def plain(self) -> bool:
        return not (self.reasoning or self.tool_format or self.calls_only)


class ReplyStream:
    """Feeds one candidate's text as it comes; returns the deltas (`content`, `reasoning_content`,
    `tool_calls` dicts) that can be sent now, and at the end the rest and the finish reason."""

    def __init__(self, rules: ReplyRules) -> None:
        self.rules = rules
        self.thinking = ReasoningStream(rules.thinking_at_start) if rules.reasoning and not rules.calls_only else None
        self.calls = ToolCallStream(rules.tool_format) if rules.tool_format and not rules.calls_only else None
        self.held = ""  # the whole reply, where the grammar made it calls: parsed at the end
        self.reasoning_tokens = 0  # the tokens of the reply's thinking, </think> included
        self.undecided_tokens = 0

    def feed(self, text: str, num_tokens: int = 0) -> list[dict[str, Any]]:
        if self.rules.calls_only:
            self.held += text
            return []
        if self.thinking is None:
            return self._deltas("", text)
        decided, thinking = self.thinking.decided, self.thinking.thinking
        reasoning, content = self.thinking.feed(text)
        if not decided:  # the reply's first tokens count once it is known whether they opened <think>
            self.undecided_tokens += num_tokens
            if self.thinking.decided and self.thinking.thought:
                self.reasoning_tokens += self.undecided_tokens
        elif thinking:
            self.reasoning_tokens += num_tokens
        return self._deltas(reasoning, content)

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        if self.rules.calls_only:
            parsed = parse_call_list(self.held, self.rules.tool_format or "hermes")
            deltas = [{"content": parsed.content}] if parsed.content else []
            return deltas + _call_deltas(parsed.tool_calls), _reason(finish_reason, parsed.tool_calls)
        reasoning, content = self.thinking.finish() if self.thinking is not None else ("", "")
        deltas = self._deltas(reasoning, content)
        calls: tuple[ToolCall, ...] = ()
        if self.calls is not None:
            rest, calls = self.calls.finish()
            deltas += [{"content": rest}] if rest else []
            deltas += _call_deltas(calls)
        return deltas, _reason(finish_reason, calls)

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if content and self.calls is not None:
            content = self.calls.feed(content)
        return out + ([{"content": content}] if content else [])


def _reason(finish_reason: str, calls: tuple[ToolCall, ...]) -> str:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _call_deltas(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """Each call as two deltas, as OpenAI streams them: its id, type and name, then its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        head = {"index": index, "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


def message_of(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the deltas add up to (as an OpenAI client reassembles a stream)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": "function", "function": dict(part["function"])})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if any("reasoning_content" in d for d in deltas) or reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def whole_reply(rules: ReplyRules, text: str, finish_reason: str, num_tokens: int = 0) -> tuple[dict[str, Any], str, int]:
    """The message, finish reason and reasoning token count of a whole reply."""
    stream = ReplyStream(rules)
    deltas = stream.feed(text, num_tokens)
    rest, reason = stream.finish(finish_reason)
    return message_of(deltas + rest), reason, stream.reasoning_tokens


def message_deltas(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message (as the non-streaming reply has it) as the deltas a stream would have fed: the
    translations that build their own blocks from deltas (Responses, Anthropic) read both the same way."""
    deltas: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        deltas.append({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": dict(call["function"])}]})
    return deltas
