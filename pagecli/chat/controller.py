"""The chat loop without a screen: reads entries, runs slash commands and turns, keeps the session.

Both front ends drive it: the Rich screen on a terminal (`pagecli.ui.chat_screen`) and the
plain text/JSONL mode (`pagecli.chat.plain`). They differ only in the ChatView they pass.
Nothing a user types ends in a traceback: every PagecliError (a RequestError too: a chat
template that rejects the conversation) becomes one line, the conversation stays as it was
before that line, and the chat goes on. The slash commands themselves are in
`pagecli.chat.slash_commands`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pagecli.chat import session as sessions
from pagecli.chat.commands import Command, parse_line, unknown_command_hint
from pagecli.chat.conversation import Conversation, Turn, readable_text
from pagecli.chat.multiline import Entry, Message
from pagecli.chat.prompt import BuiltPrompt, PromptBuilder
from pagecli.chat.session_lock import SessionLock
from pagecli.chat.slash_commands import HANDLERS
from pagecli.chat.truncation import fit_prompt, reply_reserve_tokens
from pagecli.chat.turn import StopFlag, TurnResult, TurnStats, TurnTracker, run_turn
from pagecli.chat.view import ChatOptions, ChatView, TurnRecord
from pagecli.config.settings import SamplingParams
from pagecli.errors import PagecliError


class ChatController:
    def __init__(self, engine: Any, sampling: SamplingParams, view: ChatView,
                 conversation: Conversation | None = None, options: ChatOptions | None = None,
                 session_lock: SessionLock | None = None) -> None:
        self.engine = engine
        self.sampling = sampling
        self.view = view
        self.options = options or ChatOptions()
        self.session_lock = session_lock  # held while autosaving to options.session_name; released by close()
        self.builder = PromptBuilder(engine)
        self.stop = StopFlag()
        self.last_turn: TurnStats | None = None
        self.problems = 0  # lines that ended in an error message (plain mode's exit status)
        self.conversation = Conversation()
        self.adopt(conversation or Conversation())

    # --- the loop -----------------------------------------------------------------------------
    def run(self, entries: Iterable[Entry]) -> None:
        """Handle entries until they end or the user leaves; input that ends badly (inside a block) is
        a problem line too."""
        iterator = iter(entries)
        while True:
            try:
                entry = next(iterator)
            except StopIteration:
                return
            except PagecliError as exc:
                self.problem(str(exc))
                return
            if not self.handle(entry):
                return

    def handle(self, entry: Entry) -> bool:
        """Act on one entry (a typed line, or a block sent as a message); False when the user asked to leave."""
        if isinstance(entry, Message):
            if entry.text.strip():
                self._guarded(self.send, readable_text(entry.text))
            return True
        return self.handle_line(entry)

    def handle_line(self, line: str) -> bool:
        """Act on one typed line; False when the user asked to leave."""
        parsed = parse_line(readable_text(line))
        if isinstance(parsed, Command):
            return self._guarded(self._command, parsed) is not False
        if parsed:
            self._guarded(self.send, parsed)
        return True

    def _guarded(self, action: Callable[[Any], Any], argument: Any) -> Any:
        try:
            return action(argument)
        except PagecliError as exc:
            self.problem(str(exc))
            return None

    def problem(self, message: str) -> None:
        self.problems += 1
        self.view.problem(message)

    def _command(self, command: Command) -> bool:
        if not command.known:
            self.problem(unknown_command_hint(command.name))
            return True
        if command.name == "exit":
            return False
        HANDLERS[command.name](self, command.argument)
        return True

    def close(self) -> None:
        """Let go of the session this chat held."""
        if self.session_lock is not None:
            self.session_lock.release()
            self.session_lock = None

    # --- turns ----------------------------------------------------------------------------------
    def send(self, user_text: str) -> TurnRecord | None:
        """One turn: fit the prompt, stream the reply, keep it (also when stopped), autosave.

        Until the reply begins, nothing changes: a prompt the template rejects, or one that does not
        fit, leaves the conversation as it was (the message is not kept)."""
        reserve = reply_reserve_tokens(self.sampling.max_tokens, self.engine.max_model_len)
        fitted = fit_prompt(self.conversation, user_text, self.builder, self.engine.fingerprint,
                            self.engine.max_model_len, reserve, self.options.truncate)
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
        if fitted.dropped_turns and record is not None:
            self.view.notice(
                f"The conversation outgrew max_model_len ({self.engine.max_model_len} tokens): dropped the oldest "
                f"{fitted.dropped_turns} turn(s), kept the system prompt and the newest turns."
            )
        for warning in self._engine_warnings():
            self.view.notice(warning)
        if record is None:
            self.view.notice("Stopped before the reply began; the message was not added.")
        elif self.options.autosave:
            self.autosave()
        return record

    def _keep(self, user_text: str, result: TurnResult, prompt: BuiltPrompt,
              dropped_turns: int) -> TurnRecord | None:
        """Add the turn to the conversation (a stopped reply too, unless nothing came) and remember its ids."""
        self.last_turn = result.stats
        if result.finish_reason == "abort" and not result.token_ids:
            return None
        self.conversation.drop_oldest(dropped_turns)
        self.conversation.add_turn(Turn(user_text, result.text, result.finish_reason))
        self.conversation.remember(self.builder.prefixes_after_reply(prompt, result.text, result.token_ids),
                                   self.engine.fingerprint)
        self._persist(prompt.token_ids + result.token_ids)
        return TurnRecord(self.conversation.turns_total, user_text, result, dropped_turns)

    def _persist(self, conversation_token_ids: tuple[int, ...]) -> None:
        """Hand the conversation's ids to the disk prefix store (tier 2), so that a later process
        (`--resume`, /load) prefills only its new message. Engines without a store skip this."""
        persist_prefix = getattr(self.engine, "persist_prefix", None)
        if persist_prefix is not None and self.sampling.lora is not None:
            persist_prefix(conversation_token_ids, self.sampling.lora)  # the adapter's own chains
        elif persist_prefix is not None:
            persist_prefix(conversation_token_ids)

    def _engine_warnings(self) -> list[str]:
        take_warnings = getattr(self.engine, "take_warnings", None)
        return take_warnings() if take_warnings is not None else []

    # --- the session ------------------------------------------------------------------------------
    def adopt(self, conversation: Conversation) -> None:
        """Chat on with `conversation` (a new chat, --resume, /load); known prefixes holding ids this model
        lacks, or ids that do not decode to their text (an edited file), are dropped with a notice: the
        engine would refuse every prompt, or be sent tokens the transcript does not hold."""
        spec = getattr(getattr(self.engine, "loaded", None), "spec", None)
        vocab_size = getattr(spec, "vocab_size", None)
        if isinstance(vocab_size, int) and conversation.drop_prefixes_outside(vocab_size):
            self.view.notice("The session's cached token ids do not fit this model's vocabulary; they were "
                             "dropped, and the next turn prefills the history again.")
        if conversation.fingerprint == getattr(self.engine, "fingerprint", None) and \
                conversation.drop_prefixes_unlike(self.builder.decode):
            self.view.notice("The session's cached token ids do not match its text; they were dropped, and the "
                             "next turn tokenizes and prefills the history again.")
        self.conversation = conversation

    def claim_session(self, name: str) -> None:
        """With autosave, hold the lock of the session the chat saves to from now on (and let go of the
        previous one); SessionBusy, with nothing changed, when another process holds it."""
        if not self.options.autosave or (self.session_lock is not None and self.session_lock.name == name):
            return
        claimed = sessions.lock_session(name)
        self.close()
        self.session_lock = claimed

    def autosave(self) -> None:
        name = self.options.session_name
        if name:
            try:
                sessions.save_session(name, self.conversation, self.options.model_name)
            except PagecliError as exc:
                self.problem(f"Autosave failed: {exc}")
