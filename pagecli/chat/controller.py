"""The chat loop without a screen: reads lines, runs slash commands and turns, keeps the session.

Both front ends drive it: the Rich screen on a terminal (`pagecli.ui.chat_screen`) and the
plain text/JSONL mode (`pagecli.chat.plain`). They differ only in the ChatView they pass.
Nothing a user types ends in a traceback: every PagecliError becomes one line and the chat
goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from pagecli.chat import session as sessions
from pagecli.chat.commands import COMMANDS, Command, apply_settings, describe_sampling, parse_line, unknown_command_hint
from pagecli.chat.conversation import Conversation, Turn
from pagecli.chat.prompt import BuiltPrompt, PromptBuilder
from pagecli.chat.truncation import fit_prompt, reply_reserve_tokens
from pagecli.chat.turn import StopFlag, TurnResult, TurnStats, TurnTracker, run_turn
from pagecli.config.settings import SamplingParams
from pagecli.engine.stats import EngineStats
from pagecli.errors import PagecliError

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
    autosave: bool = False  # save the session after every turn
    model_name: str | None = None  # as the user gave it; stored in sessions


class ChatController:
    def __init__(self, engine: Any, sampling: SamplingParams, view: ChatView,
                 conversation: Conversation | None = None, options: ChatOptions | None = None) -> None:
        self.engine = engine
        self.sampling = sampling
        self.view = view
        self.conversation = conversation or Conversation()
        self.options = options or ChatOptions()
        self.builder = PromptBuilder(engine)
        self.stop = StopFlag()
        self.last_turn: TurnStats | None = None
        self.problems = 0  # lines that ended in an error message (plain mode's exit status)

    # --- the loop -----------------------------------------------------------------------------
    def run(self, lines: Iterable[str]) -> None:
        for line in lines:
            if not self.handle_line(line):
                return

    def handle_line(self, line: str) -> bool:
        """Act on one typed line; False when the user asked to leave."""
        try:
            parsed = parse_line(line)
            if isinstance(parsed, Command):
                return self._command(parsed)
            if parsed:
                self.send(parsed)
        except PagecliError as exc:
            self._problem(str(exc))
        return True

    def _problem(self, message: str) -> None:
        self.problems += 1
        self.view.problem(message)

    # --- turns ----------------------------------------------------------------------------------
    def send(self, user_text: str) -> TurnRecord | None:
        """One turn: fit the prompt, stream the reply, keep it (also when stopped), autosave."""
        reserve = reply_reserve_tokens(self.sampling.max_tokens, self.engine.max_model_len)
        fitted = fit_prompt(self.conversation, user_text, self.builder, self.engine.fingerprint,
                            self.engine.max_model_len, reserve, self.options.truncate)
        if fitted.dropped_turns:
            self.conversation.drop_oldest(fitted.dropped_turns)
            self.view.notice(
                f"The conversation outgrew max_model_len ({self.engine.max_model_len} tokens): dropped the oldest "
                f"{fitted.dropped_turns} turn(s), kept the system prompt and the newest turns."
            )
        tracker = TurnTracker(self.engine, len(fitted.prompt.token_ids))
        record = None
        self.view.begin_reply(tracker.live_status)
        try:
            with self.stop.catching_sigint():
                result = run_turn(self.engine, fitted.prompt.token_ids, self.sampling, tracker,
                                  self.view.reply_text, self.stop, self.view.refresh)
            record = self._keep(user_text, result, fitted.prompt, fitted.dropped_turns)
        finally:
            self.view.end_reply(record)
        for warning in self._engine_warnings():
            self.view.notice(warning)
        if record is None:
            self.view.notice("Stopped before the reply began; the message was not added.")
        elif self.options.autosave:
            self._autosave()
        return record

    def _keep(self, user_text: str, result: TurnResult, prompt: BuiltPrompt,
              dropped_turns: int) -> TurnRecord | None:
        """Add the turn to the conversation (a stopped reply too, unless nothing came) and remember its ids."""
        self.last_turn = result.stats
        if result.finish_reason == "abort" and not result.token_ids:
            return None
        self.conversation.add_turn(Turn(user_text, result.text, result.finish_reason))
        self.conversation.remember(self.builder.prefixes_after_reply(prompt, result.text, result.token_ids),
                                   self.engine.fingerprint)
        self._persist(prompt.token_ids + result.token_ids)
        return TurnRecord(self.conversation.turns_total, user_text, result, dropped_turns)

    def _persist(self, conversation_token_ids: tuple[int, ...]) -> None:
        """Hand the conversation's ids to the disk prefix store (tier 2), so that a later process
        (`--resume`, /load) prefills only its new message. Engines without a store skip this."""
        persist_prefix = getattr(self.engine, "persist_prefix", None)
        if persist_prefix is not None:
            persist_prefix(conversation_token_ids)

    def _engine_warnings(self) -> list[str]:
        take_warnings = getattr(self.engine, "take_warnings", None)
        return take_warnings() if take_warnings is not None else []

    def _autosave(self) -> None:
        name = self.options.session_name
        if name:
            try:
                sessions.save_session(name, self.conversation, self.options.model_name)
            except PagecliError as exc:
                self._problem(f"Autosave failed: {exc}")

    # --- commands -------------------------------------------------------------------------------
    def _command(self, command: Command) -> bool:
        if not command.known:
            self._problem(unknown_command_hint(command.name))
            return True
        if command.name == "exit":
            return False
        handler = getattr(self, f"_cmd_{command.name}")
        handler(command.argument)
        return True

    def _cmd_help(self, argument: str) -> None:
        self.view.show_help(list(COMMANDS.values()))

    def _cmd_system(self, argument: str) -> None:
        if not argument:
            current = self.conversation.system
            self.view.notice(f"System prompt: {current}" if current else "No system prompt is set.")
        elif argument == "-":
            self.conversation.set_system(None)
            self.view.notice("System prompt cleared.")
        else:
            self.conversation.set_system(argument)
            self.view.notice("System prompt set; it applies from the next message.")

    def _cmd_reset(self, argument: str) -> None:
        self.conversation.reset()
        self.view.notice("Conversation cleared; the system prompt stays.")

    def _cmd_save(self, argument: str) -> None:
        name = argument or self.options.session_name or sessions.default_session_name()
        path = sessions.save_session(name, self.conversation, self.options.model_name)
        self.options.session_name = name
        self.view.notice(f"Saved session '{name}' ({len(self.conversation.turns)} turns) to {path}.")

    def _cmd_load(self, argument: str) -> None:
        if not argument:
            raise PagecliError("Usage: /load NAME; `pagecli chat --list-sessions` shows the saved sessions.")
        conversation, data = sessions.load_session(argument)
        self.conversation = conversation
        self.options.session_name = argument
        self.view.show_transcript(conversation)
        saved_model = data.get("model")
        note = f" (it was saved with model '{saved_model}')" if saved_model != self.options.model_name else ""
        self.view.notice(f"Loaded session '{argument}': {len(conversation.turns)} turns{note}.")

    def _cmd_stats(self, argument: str) -> None:
        self.view.show_stats(self.engine.stats())

    def _cmd_pool(self, argument: str) -> None:
        self.view.toggle_pool(self.engine.stats(include_block_states=True), self.last_turn)

    def _cmd_set(self, argument: str) -> None:
        if argument:
            self.sampling = apply_settings(self.sampling, argument)
        self.view.notice(f"Sampling: {describe_sampling(self.sampling)}.")
