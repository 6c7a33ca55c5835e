"""A stand-in Engine for serve tests about how replies are read (tool calls, reasoning), not about models:
it answers every request with the next scripted reply, a few characters per step, and records the
prompt and sampling settings the server gave it. `scripted_server` runs the real server stack on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagecli.config import SamplingParams
from pagecli.engine import EngineStats, RequestEvent
from pagecli.serve.request_log import RequestLog
from pagecli.serve.server import ServeOptions, build_state
from serve_helpers import serving

CHARS_PER_TOKEN = 3
CHATML_TOOLS_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools> reply with <tool_call>{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class _TemplateTokenizer:
    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: Any, tokenize: bool = False, add_generation_prompt: bool = False,
                            tools: Any = None) -> str:
        from pagecli.models.chat_template import render_chat_template

        return render_chat_template(self.chat_template, messages=messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt)


class ScriptedEngine:
    max_model_len = 4096
    model_name = "scripted"

    def __init__(self, replies: list[str], chat_template: str = CHATML_TOOLS_TEMPLATE) -> None:
        self.replies = list(replies)
        self.chat_template = chat_template
        self.tokenizer = _TemplateTokenizer(chat_template)
        self.loaded = SimpleNamespace(folder=Path("scripted"))
        self.prompts: list[Any] = []
        self.samplings: list[SamplingParams] = []
        self._running: dict[str, tuple[list[str], SamplingParams, int]] = {}

    def script(self, *replies: str) -> None:
        """The replies of the next requests, in order (the last one repeats)."""
        self.replies = list(replies)

    def encode(self, prompt: Any) -> list[int]:
        self.prompts.append(prompt)
        return [1, 2, 3]

    def add_request(self, token_ids: list[int], sampling: SamplingParams, request_id: str) -> str:
        self.samplings.append(sampling)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        pieces = [reply[i:i + CHARS_PER_TOKEN] for i in range(0, len(reply), CHARS_PER_TOKEN)]
        self._running[request_id] = (pieces, sampling, 0)
        return request_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestEvent]:
        events = []
        for request_id, (pieces, sampling, done) in list(self._running.items()):
            text = pieces[done] if done < len(pieces) else ""
            done += 1
            finished = done >= len(pieces) or done >= sampling.max_tokens
            reason = ("stop" if done >= len(pieces) else "length") if finished else None
            for index in range(sampling.n):
                events.append(RequestEvent(request_id, text, (7,), finished, reason, 3, done, 0, None, index))
            if finished:
                del self._running[request_id]
            else:
                self._running[request_id] = (pieces, sampling, done)
        return events

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def stats(self, include_block_states: bool = False) -> EngineStats:
        zeros = dict.fromkeys(("block_size", "num_blocks", "kv_bytes_per_block", "kv_bytes_total", "weights_bytes",
                               "blocks_free", "blocks_cached", "blocks_active", "blocks_shared", "num_running",
                               "num_waiting", "num_preemptions", "num_steps", "prompt_tokens_computed",
                               "tokens_generated", "prefix_query_tokens", "prefix_hit_tokens",
                               "prefix_disk_hit_tokens", "evictions"), 0)
        return EngineStats(**zeros, device="cpu", dtype="float32", attention_backend="scripted", max_model_len=4096)

    def take_warnings(self) -> list[str]:
        return []


@contextmanager
def scripted_server(engine: ScriptedEngine, reasoning_format: str = "separate") -> Iterator[str]:
    """The server on `engine`, listening on a free port; yields its base URL."""
    settings = SimpleNamespace(model="scripted", sampling=SamplingParams(temperature=0, max_tokens=200))
    options = ServeOptions(port=0, grace_s=1, reasoning_format=reasoning_format)
    state = build_state(engine, settings, options, RequestLog(sink=lambda line: None))
    with serving(state, grace_s=1) as base_url:
        yield base_url
