"""Chat turns that go wrong or are taken back: a chat template that rejects a conversation, text that is
not valid Unicode, /retry and /undo. The conversation is always left as it was before the failed line."""

from __future__ import annotations

import json
import shutil

import pytest
from chat_helpers import BLOCK_SIZE, GREEDY, RecordingView, cli_args, make_engine, run_cli

from pagecli.chat.controller import ChatController, ChatOptions
from pagecli.chat.conversation import Conversation
from pagecli.chat.prompt import PromptBuilder
from pagecli.errors import RequestError
from pagecli.paths import sessions_dir
from tiny_models import CHATML

SYSTEM_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must come first') }}{% endif %}{% endfor %}")
TWO_TURNS_AT_MOST = ("{% if messages|length > 4 %}{{ raise_exception('This model takes at most two turns') }}"
                     "{% endif %}")
BROKEN_ON_BOOM = "{% for m in messages %}{% if m['content'] == 'boom' %}{{ m['content'] + 1 }}{% endif %}{% endfor %}"
DIVIDES_BY_ZERO = "{% for m in messages %}{% if m['content'] == 'zero' %}{{ 1 / 0 }}{% endif %}{% endfor %}"


def chat_with_template(folder, template: str, conversation: Conversation | None = None):
    engine = make_engine(folder)
    engine.tokenizer.chat_template = template + CHATML
    view = RecordingView()
    return ChatController(engine, GREEDY, view, conversation), view


# --- a chat template that rejects the conversation -----------------------------------------------------------
def test_a_template_rejection_is_a_request_error_with_the_templates_own_words(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.tokenizer.chat_template = SYSTEM_FIRST + CHATML
    builder = PromptBuilder(engine)
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(RequestError) as caught:
        builder.render(messages)
    assert str(caught.value) == ("The chat template rejected this conversation: System message must come first; "
                                 "if the model takes no system prompt, /system - removes it.")


def test_a_rejected_turn_is_one_problem_line_and_the_conversation_stays_as_it_was(tiny_llama):
    chat, view = chat_with_template(tiny_llama, TWO_TURNS_AT_MOST)
    chat.handle_line("one")
    chat.handle_line("two")
    known_before = list(chat.conversation.known_prefixes)
    assert chat.handle_line("three")
    assert view.problems == ["The chat template rejected this conversation: This model takes at most two turns."]
    assert [t.user for t in chat.conversation.turns] == ["one", "two"] and chat.conversation.turns_total == 2
    assert chat.conversation.known_prefixes == known_before
    chat.handle_line("/undo")
    chat.handle_line("three")  # the chat goes on
    assert [t.user for t in chat.conversation.turns] == ["one", "three"] and len(view.problems) == 1


@pytest.mark.parametrize("template, line, error", [(BROKEN_ON_BOOM, "boom", "TypeError"),
                                                   (DIVIDES_BY_ZERO, "zero", "ZeroDivisionError")])
def test_a_template_that_breaks_on_one_message_does_not_end_the_chat(tiny_llama, template, line, error):
    chat, view = chat_with_template(tiny_llama, template)
    chat.handle_line("fine")
    assert chat.handle_line(line)
    assert view.problems[-1].startswith(f"The chat template failed on this conversation ({error}:")
    assert [t.user for t in chat.conversation.turns] == ["fine"]
    chat.handle_line("fine again")
    assert [t.user for t in chat.conversation.turns] == ["fine", "fine again"]


def test_plain_mode_reports_the_rejection_and_answers_the_next_line(tiny_llama, tmp_path, capsys, monkeypatch):
    folder = shutil.copytree(tiny_llama, tmp_path / "two-turns")
    (folder / "chat_template.jinja").write_text(TWO_TURNS_AT_MOST + CHATML, encoding="utf-8")
    code, out, err = run_cli(cli_args(folder, "--jsonl"), "one\ntwo\nthree\n/undo\nthree\n", capsys, monkeypatch)
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and "Traceback" not in err
    assert [r.get("user") or r["error"] for r in records] == [
        "one", "two", "The chat template rejected this conversation: This model takes at most two turns.", "three"]
    assert records[-1]["turn"] == 2


def test_a_typed_line_with_lone_surrogates_is_sent_with_replacement_characters(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view)
    chat.handle_line("caf\udce9 \ud800")
    assert not view.problems and chat.conversation.turns[0].user == "caf\ufffd \ufffd"


# --- /retry and /undo ------------------------------------------------------------------------------------------
def test_retry_and_undo_with_no_exchange_say_so(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view)
    chat.handle_line("/retry")
    chat.handle_line("/undo")
    assert view.notices == ["Nothing to retry yet: no exchange in this conversation.",
                            "Nothing to undo yet: no exchange in this conversation."]
    assert not view.problems and chat.problems == 0 and chat.conversation.turns == []


def test_retry_regenerates_the_last_reply_from_the_cached_prompt(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view, Conversation(system="Be brief."))
    chat.handle_line("first message")
    chat.handle_line("second message")
    before = view.records[-1]
    chat.handle_line("/retry")
    again = view.records[-1]
    assert not view.problems and view.notices[-1] == "Retrying: 'second message'"
    assert [t.user for t in chat.conversation.turns] == ["first message", "second message"]
    assert again.number == 2 and chat.conversation.turns_total == 2
    assert again.result.text == before.result.text  # greedy: the same reply, now generated again
    stats = again.result.stats
    assert stats.prompt_tokens == before.result.stats.prompt_tokens
    assert stats.cached_tokens == (stats.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # all but the last token
    assert stats.prefilled_tokens == stats.prompt_tokens - stats.cached_tokens


def test_undo_drops_the_last_exchange_and_the_next_turn_still_reuses_the_history(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view, Conversation(system="Be brief."))
    chat.handle_line("first message")
    first = view.records[-1].result.stats
    chat.handle_line("second message")
    chat.handle_line("/undo")
    assert view.notices[-1] == "Dropped the last exchange: 'second message'"
    assert [t.user for t in chat.conversation.turns] == ["first message"] and chat.conversation.turns_total == 1
    chat.handle_line("another second message")
    record = view.records[-1]
    assert record.number == 2 and not view.problems
    # The history is the first turn exactly: every full block it computed comes from the cache.
    assert record.result.stats.cached_tokens == (first.prompt_tokens + first.completion_tokens - 1) // 16 * 16


def test_undo_autosaves_and_retry_is_in_help(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view,
                          options=ChatOptions(session_name="undone", autosave=True))
    chat.handle_line("one")
    chat.handle_line("two")
    chat.handle_line("/undo")
    saved = json.loads((sessions_dir() / "undone.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["one"] and saved["turns_total"] == 1
    chat.handle_line("/help")
    usages = [usage for usage, _ in view.help_rows]
    assert "/retry" in usages and "/undo" in usages
