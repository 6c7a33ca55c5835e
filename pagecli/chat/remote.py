"""`pagecli chat --server URL`: the same chat, its turns answered by a running `pagecli serve`.

`ServerEngine` is what the chat loop reads of an engine, answered over HTTP: `stats()` from GET /v1/pool
(the server's own EngineStats, so the pool panel is the one `pagecli chat` draws, live while any client
generates), and one turn as a streamed POST /v1/chat/completions of the conversation's messages (the
server's chat template and prefix cache do the rest: a follow-up prefills only its new message there).
`RemoteChatController` is the ChatController with that turn in place of the local prompt ids: slash
commands, sessions and both views are the same. HTTP: pagecli.batch.remote.ServerConnection.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from pagecli.batch.remote import ServerConnection, api_fields
from pagecli.chat.controller import ChatController
from pagecli.chat.conversation import Conversation, Turn
from pagecli.chat.turn import TurnResult, TurnStats, decode_rate
from pagecli.chat.view import TurnRecord
from pagecli.config.settings import SamplingParams
from pagecli.engine.stats import EngineStats
from pagecli.errors import PagecliError

_TIMEOUT_S = 30.0  # connecting, and the longest wait for the next streamed piece


class ServerEngine:
    """A running `pagecli serve` as the chat loop sees an engine (module docstring)."""

    fingerprint = None  # the server keeps the prefixes: the client remembers none
    tokenizer = None  # the server's chat template and tokenizer render the messages
    chat_template = None

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.connection = ServerConnection(url, api_key)
        self.model = self.connection.model()
        self.max_model_len = self.stats().max_model_len

    # --- what the chat loop reads of an engine ------------------------------------------------
    def stats(self, include_block_states: bool = False) -> EngineStats:
        state = self.connection.get("/v1/pool")
        return EngineStats.from_dict(state["stats"], state.get("block_map") if include_block_states else None)

    def check_structured(self, spec: Any) -> None:
        raise PagecliError("/format needs the model in this process; with --server, send response_format to the "
                           "server's API instead.")

    def take_warnings(self) -> list[str]:
        return []

    # --- one turn -----------------------------------------------------------------------------
    def stream_reply(self, messages: list[dict[str, str]], sampling: SamplingParams,
                     should_stop: Callable[[], bool]) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """The reply's text pieces as they stream, each with None, then ("", the final chunk's usage and
        finish reason); stops reading (the server cancels) as soon as should_stop() says so."""
        body = {"model": self.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
                **api_fields(sampling)}
        finish_reason = None
        usage: dict[str, Any] = {}
        with self.connection.open("/v1/chat/completions", body, timeout_s=_TIMEOUT_S) as response:
            for raw in response:
                if should_stop():
                    yield "", {"finish_reason": "abort", "usage": usage}
                    return
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise PagecliError(f"The server stopped the reply: {chunk['error'].get('message', chunk['error'])}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    finish_reason = choice.get("finish_reason") or finish_reason
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text, None
        yield "", {"finish_reason": finish_reason or "stop", "usage": usage}


class RemoteChatController(ChatController):
    """ChatController whose turns run on a `pagecli serve` (ServerEngine): the conversation's messages go to
    the server, whose prefix cache serves what it has seen; nothing is prefilled or persisted here."""

    engine: ServerEngine

    def adopt(self, conversation: Conversation) -> None:
        conversation.known_prefixes = []  # token ids of a local engine: the server has its own cache
        super().adopt(conversation)

    def send(self, user_text: str) -> TurnRecord | None:
        messages = self.conversation.messages(pending_user=user_text)
        turn = _LiveTurn(self.engine)
        record = None
        self.view.begin_reply(turn.live_status)
        try:
            with self.stop.catching_sigint():
                result = turn.run(messages, self.sampling, self.view.reply_text, self.stop, self.view.refresh)
            self.last_turn = result.stats
            if not (result.finish_reason == "abort" and not result.text):
                self.conversation.add_turn(Turn(user_text, result.text, result.finish_reason))
                record = TurnRecord(self.conversation.turns_total, user_text, result, 0)
        finally:
            self.view.end_reply(record)
        if record is None:
            self.view.notice("Stopped before the reply began; the message was not added.")
        elif self.options.autosave:
            self.autosave()
        return record


class _LiveTurn:
    """One turn's figures as they stream (tokens counted as the server's pieces come, one per piece, until its
    usage says), and the live status the views poll: the server's pool now, and this turn so far."""

    def __init__(self, engine: ServerEngine) -> None:
        self.engine = engine
        self.pieces: list[str] = []
        self.sent_s = time.perf_counter()
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.prompt_tokens = self.cached_tokens = 0

    def stats(self, completion_tokens: int | None = None) -> TurnStats:
        tokens = len(self.pieces) if completion_tokens is None else completion_tokens
        rate = decode_rate(self.first_s, self.last_s, tokens)
        return TurnStats(prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens, cached_disk_tokens=0,
                         prefilled_tokens=self.prompt_tokens - self.cached_tokens, completion_tokens=tokens,
                         ttft_s=None if self.first_s is None else self.first_s - self.sent_s, decode_tokens_per_s=rate)

    def live_status(self) -> tuple[EngineStats, TurnStats]:
        return self.engine.stats(include_block_states=True), self.stats()

    def run(self, messages: list[dict[str, str]], sampling: SamplingParams, on_text: Callable[[str], None],
            should_stop: Callable[[], bool], on_step: Callable[[], None]) -> TurnResult:
        end: dict[str, Any] = {}
        for text, final in self.engine.stream_reply(messages, sampling, should_stop):
            if final is not None:
                end = final
                break
            now = time.perf_counter()
            self.first_s = self.first_s or now
            self.last_s = now
            self.pieces.append(text)
            on_text(text)
            on_step()
        usage = end.get("usage") or {}
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        completion = usage.get("completion_tokens")
        return TurnResult("".join(self.pieces), (), end.get("finish_reason", "abort"),
                          self.stats(None if completion is None else int(completion)), self.engine.stats())
