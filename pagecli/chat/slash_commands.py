"""What each slash command does to a running chat (the list, the parsing and /set's values are in
`pagecli.chat.commands`). A handler gets the controller and the text after the command's name;
a PagecliError it raises becomes one problem line and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from pagecli.chat import session as sessions
from pagecli.chat.commands import COMMANDS, apply_settings, describe_format, describe_sampling
from pagecli.chat.conversation import Conversation
from pagecli.chat.turn import TurnStats
from pagecli.chat.view import ChatOptions, ChatView
from pagecli.config.settings import SamplingParams
from pagecli.config.structured import StructuredSpec, spec_from_schema_file
from pagecli.errors import PagecliError


class ChatController(Protocol):
    """What a slash command uses of the running chat: pagecli.chat.controller.ChatController, which
    dispatches to the handlers below (so this module does not import it)."""

    engine: Any
    sampling: SamplingParams
    view: ChatView
    options: ChatOptions
    conversation: Conversation
    last_turn: TurnStats | None

    def send(self, user_text: str) -> Any: ...
    def adopt(self, conversation: Conversation) -> None: ...
    def claim_session(self, name: str) -> None: ...
    def autosave(self) -> None: ...

_PREVIEW_CHARS = 40


def show_help(chat: ChatController, argument: str) -> None:
    chat.view.show_help(list(COMMANDS.values()))


def system(chat: ChatController, argument: str) -> None:
    if not argument:
        current = chat.conversation.system
        chat.view.notice(f"System prompt: {current}" if current else "No system prompt is set.")
    elif argument == "-":
        chat.conversation.set_system(None)
        chat.view.notice("System prompt cleared.")
    else:
        chat.conversation.set_system(argument)
        chat.view.notice("System prompt set; it applies from the next message.")


def reset(chat: ChatController, argument: str) -> None:
    chat.conversation.reset()
    chat.view.notice("Conversation cleared; the system prompt stays.")


def retry(chat: ChatController, argument: str) -> None:
    """The last reply again: drop it, send the same message (its prompt comes from the prefix cache).
    When no new reply comes (Ctrl-C before it began, a failure), the old one stays."""
    last = chat.conversation.take_last_turn()
    if last is None:
        chat.view.notice("Nothing to retry yet: no exchange in this conversation.")
        return
    chat.view.notice(f"Retrying: {_preview(last.user)}")
    record = None
    try:
        record = chat.send(last.user)
    finally:
        if record is None:
            chat.conversation.add_turn(last)
            chat.view.notice("The previous reply stays.")


def undo(chat: ChatController, argument: str) -> None:
    last = chat.conversation.take_last_turn()
    if last is None:
        chat.view.notice("Nothing to undo yet: no exchange in this conversation.")
        return
    chat.view.notice(f"Dropped the last exchange: {_preview(last.user)}")
    if chat.options.autosave:
        chat.autosave()


def save(chat: ChatController, argument: str) -> None:
    name = sessions.check_name(argument or chat.options.session_name or sessions.default_session_name())
    chat.claim_session(name)
    path = sessions.save_session(name, chat.conversation, chat.options.model_name)
    chat.options.session_name = name
    chat.view.notice(f"Saved session '{name}' ({len(chat.conversation.turns)} turns) to {path}.")


def load(chat: ChatController, argument: str) -> None:
    if not argument:
        raise PagecliError("Usage: /load NAME; `pagecli chat --list-sessions` shows the saved sessions.")
    session = sessions.load_session(argument)
    chat.claim_session(argument)
    chat.adopt(session.conversation)
    chat.options.session_name = argument
    chat.view.show_transcript(session.conversation)
    saved_model = session.model
    note = f" (it was saved with model '{saved_model}')" if saved_model != chat.options.model_name else ""
    chat.view.notice(f"Loaded session '{argument}': {len(session.conversation.turns)} turns{note}.")


def stats(chat: ChatController, argument: str) -> None:
    chat.view.show_stats(chat.engine.stats())


def pool(chat: ChatController, argument: str) -> None:
    chat.view.toggle_pool(chat.engine.stats(include_block_states=True), chat.last_turn)


def set_sampling(chat: ChatController, argument: str) -> None:
    if argument:
        chat.sampling = apply_settings(chat.sampling, argument)
    chat.view.notice(f"Sampling: {describe_sampling(chat.sampling)}.")


def output_format(chat: ChatController, argument: str) -> None:
    """`/format json | SCHEMA_FILE | off`: constrained decoding for the next replies. A schema the engine cannot
    enforce is refused now, not at the next message."""
    if argument:
        word = argument.lower()
        spec = None if word == "off" else StructuredSpec.json_object() if word == "json" else \
            spec_from_schema_file(argument)
        if spec is not None:
            chat.engine.check_structured(spec)
        chat.sampling = replace(chat.sampling, structured=spec)
    chat.view.notice(describe_format(chat.sampling.structured))


def lora(chat: ChatController, argument: str) -> None:
    """`/lora NAME [SCALE]`: the next replies from that adapter (its own prefix-cache blocks); `/lora off`: the
    base model again. Each adapter's replies build on the same conversation text."""
    adapters = getattr(chat.engine, "adapters", None)
    names = tuple(adapters.names) if adapters is not None else ()
    if not argument:
        current = chat.sampling.lora
        shown = ", ".join(names) if names else "none (start chat with --lora NAME=PATH)"
        chat.view.notice(f"LoRA adapter: {current or 'none (the base model)'}; adapters: {shown}.")
        return
    name, _, scale_text = argument.partition(" ")
    if name.lower() == "off":
        chat.sampling = replace(chat.sampling, lora=None, lora_scale=1.0)
        chat.view.notice("Replies come from the base model.")
        return
    if name not in names:
        shown = ", ".join(names) if names else "none (start chat with --lora NAME=PATH)"
        raise PagecliError(f"No LoRA adapter named '{name}'; this chat has: {shown}.")
    try:
        scale = float(scale_text) if scale_text.strip() else 1.0
    except ValueError:
        raise PagecliError(f"/lora's scale must be a number (got '{scale_text.strip()}').") from None
    chat.sampling = replace(chat.sampling, lora=name, lora_scale=scale)
    chat.view.notice(f"Replies come from LoRA adapter '{name}'" + (f" at scale {scale:g}." if scale != 1 else "."))


def _preview(text: str) -> str:
    line = " ".join(text.split())
    return f"'{line}'" if len(line) <= _PREVIEW_CHARS else f"'{line[:_PREVIEW_CHARS - 3]}...'"


HANDLERS: dict[str, Callable[[ChatController, str], None]] = {
    "help": show_help, "system": system, "reset": reset, "retry": retry, "undo": undo, "save": save, "load": load,
    "stats": stats, "pool": pool, "set": set_sampling, "format": output_format, "lora": lora,
}
