"""What the chat loop shows through and is told: the view a front end implements (the Rich screen,
the plain mode), the chat's options and a finished turn's record. Below the controller and the slash
commands, which both use them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pagecli.chat.conversation import Conversation
from pagecli.chat.turn import TurnResult, TurnStats
from pagecli.engine.stats import EngineStats

LiveStatus = Callable[[], tuple[EngineStats, TurnStats]]


@dataclass(frozen=True)
class TurnRecord:
    """A finished turn as the views show it."""

    number: int  # 1-based, counting turns dropped by truncation
    user: str
    result: TurnResult
    dropped_turns: int


class ChatView(Protocol):
    def notice(self, message: str) -> None: ...
    def problem(self, message: str) -> None: ...
    def begin_reply(self, live_status: LiveStatus) -> None: ...
    def reply_text(self, delta: str) -> None: ...
    def refresh(self) -> None: ...
    def end_reply(self, record: TurnRecord | None) -> None: ...  # None: the turn failed before a reply
    def show_help(self, rows: list[tuple[str, str]]) -> None: ...
    def show_stats(self, stats: EngineStats) -> None: ...
    def toggle_pool(self, stats: EngineStats, turn: TurnStats | None) -> None: ...
    def show_transcript(self, conversation: Conversation) -> None: ...


@dataclass
class ChatOptions:
    truncate: bool = True  # False (--no-truncate): a too-long conversation is an error message
    session_name: str | None = None  # where /save without a name and autosave write
    autosave: bool = False  # save the session after every turn (and hold its lock meanwhile)
    model_name: str | None = None  # as the user gave it; stored in sessions
