"""The OpenAI response bodies: chat.completion and text_completion objects, their streamed chunks, and
`usage` (with prompt_tokens_details.cached_tokens from prefix-cache hits)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagecli.serve.jobs import Job


@dataclass
class Shape:
    """What every body of one response shares: its id, object names, model and creation time."""

    kind: str  # "chat" or "completion"
    response_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, job: Job, model: str) -> Shape:
        prefix = "chatcmpl" if job.kind == "chat" else "cmpl"
        return cls(job.kind, f"{prefix}-{job.job_id}", model)

    def _head(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str | None,
               message: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            message = message or {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def completion(self, texts: list[str], finish_reasons: list[str], usage: dict[str, Any],
                   messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """`messages`: each chat candidate's message where its reply was read for reasoning or tool calls."""
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        choices = [self.choice(i, text, reason, messages[i] if messages else None)
                   for i, (text, reason) in enumerate(zip(texts, finish_reasons))]
        return {**self._head(name), "choices": choices, "usage": usage}

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            if not first and not text:
                delta = {}  # the closing chunk carries only the finish_reason
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def delta_chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A chat chunk with a delta of any kind (content, reasoning_content, tool_calls)."""
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage}


def usage(job: Job, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Prompt tokens count once for all n candidates, as OpenAI counts them; completion tokens add up, as
    do the reasoning tokens among them (given where replies are read for reasoning)."""
    out = {
        "prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pagecli"}
