"""A reasoning model's thinking split from its answer: `<think>...</think>` at the start of the reply
(or, where the chat template's generation prompt already opened `<think>`, everything up to
`</think>`), whole or while the reply streams.

Only a reply that starts with `<think>` (after whitespace), or a prompt that ends inside one, is split:
a `<think>` later in an answer is the answer's text. A reply that ends before `</think>` is all
reasoning and no content (it ran out of tokens while thinking; the caller says so).
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class SplitReply:
    reasoning: str | None  # None: the reply did not think
    content: str
    thinking_unfinished: bool = False  # the reply ended before </think>


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside `<think>` (DeepSeek-R1-style generation prompts)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(text: str, thinking_at_start: bool = False) -> SplitReply:
    stream = ReasoningStream(thinking_at_start)
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    if not stream.thought:
        return SplitReply(None, text)
    return SplitReply(reasoning + rest_reasoning, content + rest_content, stream.thinking)


class ReasoningStream:
    """Feeds reply text, returns (reasoning, content) to send now. Text that may still become `<think>`
    or `</think>` is held until it cannot; reasoning loses the whitespace around it, as content does
    its leading whitespace after `</think>`."""

    def __init__(self, thinking_at_start: bool = False) -> None:
        self.thinking = thinking_at_start  # inside <think> now
        self.thought = thinking_at_start  # the reply has (or had) a thinking part
        self.decided = thinking_at_start  # whether the reply's start has been seen past <think>
        self.after_close = False  # content that follows </think>: its leading whitespace is dropped
        self.pending = ""
        self.reasoning_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        if not self.decided:
            head = self.pending.lstrip()
            if OPEN.startswith(head):
                return "", ""  # may still be <think>
            self.decided = True
            if head.startswith(OPEN):
                self.thinking = self.thought = True
                self.pending = head[len(OPEN):]
        if self.thinking:
            reasoning = self._reasoning_part()
        if not self.thinking:
            content = self._content_part()
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning where the reply ended while thinking, else content."""
        rest, self.pending = self.pending, ""
        if self.thinking:
            return self._start_reasoning(rest.rstrip()), ""
        if self.after_close:
            rest = rest.lstrip()
        return "", rest

    def _reasoning_part(self) -> str:
        close = self.pending.find(CLOSE)
        if close >= 0:
            out = self.pending[:close].rstrip()
            self.pending = self.pending[close + len(CLOSE):]
            self.thinking, self.after_close = False, True
            return self._start_reasoning(out)
        keep = _tail_that_may_become(self.pending, CLOSE)
        cut = len(self.pending) - keep
        body = self.pending[:cut]
        safe = len(body.rstrip())  # trailing whitespace waits: it is dropped if </think> follows
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return self._start_reasoning(out)

    def _start_reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def _content_part(self) -> str:
        if self.after_close:
            self.pending = self.pending.lstrip()
            if not self.pending:
                return ""
            self.after_close = False
        out, self.pending = self.pending, ""
        return out


def _tail_that_may_become(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
