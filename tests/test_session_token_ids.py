"""A session file's `known_prefixes` token ids are checked against their text when the chat takes the
session: ids that do not decode to the text are dropped with a notice, never sent to the model."""

from __future__ import annotations

import copy

from chat_helpers import GREEDY, RecordingView, make_engine

from pagecli.chat import session as sessions
from pagecli.chat.controller import ChatController
from pagecli.chat.conversation import KnownPrefix


def a_saved_chat(engine, name: str):
    chat = ChatController(engine, GREEDY, RecordingView())
    chat.handle_line("hello there")
    sessions.save_session(name, chat.conversation, "tiny")
    return chat.conversation


def test_ids_saved_by_a_chat_are_kept_and_reused(tiny_llama):
    engine = make_engine(tiny_llama)
    saved = a_saved_chat(engine, "honest")
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)
    chat.handle_line("/load honest")
    assert chat.conversation.known_prefixes == saved.known_prefixes and saved.known_prefixes
    assert not any("do not match" in n for n in view.notices)


def test_ids_prepended_to_a_known_prefix_are_dropped_and_never_reach_the_model(tiny_llama):
    """Reproducer: 1,000 ids prepended to a session's known prefix gave prompt_tokens 1,067 instead of 67,
    the transcript unchanged (300 here: the tiny model's context is 512)."""
    engine = make_engine(tiny_llama, max_model_len=512, num_blocks=200)
    conversation = copy.deepcopy(a_saved_chat(engine, "edited"))
    conversation.known_prefixes = [KnownPrefix(p.text, (7,) * 300 + p.token_ids) for p in conversation.known_prefixes]
    sessions.save_session("edited", conversation, "tiny")

    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)
    chat.handle_line("/load edited")
    assert any("cached token ids do not match its text" in n for n in view.notices)
    assert chat.conversation.known_prefixes == []
    chat.handle_line("and now?")
    prompt_tokens = view.records[-1].result.stats.prompt_tokens
    assert prompt_tokens < 200, prompt_tokens
