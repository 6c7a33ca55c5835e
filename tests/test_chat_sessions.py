"""Session files: every field checked on load with the file and the field named, damaged files never
end a chat or hide the other sessions, any text saves, and one process at a time holds a session."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys

import pytest
from chat_helpers import GREEDY, RecordingView, cli_args, make_engine, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from pagecli.chat import session as sessions
from pagecli.chat.controller import ChatController
from pagecli.chat.view import ChatOptions
from pagecli.chat.conversation import Conversation, KnownPrefix, Turn
from pagecli.errors import PagecliError
from pagecli.paths import sessions_dir

GOOD = {"format": 1, "name": "s", "model": "tiny", "updated": "2025-01-01T00:00:00+00:00", "system": "sys",
        "turns": [{"user": "hi", "assistant": "hello", "finish_reason": "stop"}], "turns_total": 1,
        "known_prefixes": {"fingerprint": "fp", "prefixes": [{"text": "abc", "token_ids": [5, 6, 7]}]}}


def write_session(name: str, data: object | None = None, text: str | None = None, raw: bytes | None = None):
    sessions_dir().mkdir(parents=True, exist_ok=True)
    path = sessions_dir() / f"{name}.json"
    if raw is None:
        raw = (text if text is not None else json.dumps(data)).encode("utf-8")
    path.write_bytes(raw)
    return path


def with_field(field: str, value: object) -> dict:
    return {**GOOD, field: value}


# --- every field checked, named in the message ------------------------------------------------------------
BAD_FIELDS = [
    (with_field("known_prefixes", []), "'known_prefixes' must be a JSON object (got a list)"),
    (with_field("known_prefixes", {"prefixes": {}}), "'known_prefixes.prefixes' must be a list (got an object)"),
    (with_field("known_prefixes", {"prefixes": [{"text": "a", "token_ids": [1, "x"]}]}),
     "'known_prefixes.prefixes[0].token_ids[1]' must be a token id"),
    (with_field("known_prefixes", {"prefixes": [{"text": "a", "token_ids": [1, 2.0]}]}),
     "'known_prefixes.prefixes[0].token_ids[1]' must be a token id"),
    (with_field("known_prefixes", {"prefixes": [{"text": "a", "token_ids": [-1]}]}),
     "'known_prefixes.prefixes[0].token_ids[0]' must be a token id"),
    (with_field("known_prefixes", {"prefixes": [{"text": 3, "token_ids": []}]}),
     "'known_prefixes.prefixes[0].text' must be a string (got 3)"),
    (with_field("turns_total", "3"), "'turns_total' must be a whole number"),
    (with_field("turns_total", True), "'turns_total' must be a whole number"),
    (with_field("turns_total", -2), "'turns_total' must be a whole number"),
    (with_field("turns", 3), "'turns' must be a list (got 3)"),
    (with_field("turns", ["hi"]), "'turns[0]' must be a JSON object (got \"hi\")"),
    (with_field("turns", [{"user": 5, "assistant": "x"}]), "'turns[0].user' must be a string (got 5)"),
    (with_field("turns", [{"user": "u"}]), "'turns[0].assistant' must be a string (got null)"),
    (with_field("turns", [{"user": "u", "assistant": "a", "finish_reason": 1}]),
     "'turns[0].finish_reason' must be a string"),
    (with_field("system", ["a"]), "'system' must be a string (got a list)"),
    (with_field("model", 7), "'model' must be a string (got 7)"),
    (with_field("format", 99), "format 99, written by a newer pagecli"),
    ([GOOD], "the file must be a JSON object (got a list)"),
]


@pytest.mark.parametrize("data, expected", BAD_FIELDS, ids=[expected[:40] for _, expected in BAD_FIELDS])
def test_a_wrong_field_is_named_with_the_file(data, expected):
    path = write_session("bad", data)
    with pytest.raises(PagecliError) as caught:
        sessions.load_session("bad")
    message = str(caught.value)
    assert f"Session file '{path}' cannot be read: " in message and expected in message
    assert message.endswith("; move it away or pick another name.") and "\n" not in message


@pytest.mark.parametrize("text, expected", [
    ('{"turns_total": 1e400}', "'turns_total' must be a whole number from 0 to 9007199254740992 (got Infinity)"),
    ('{"turns_total": NaN}', "'turns_total' must be a whole number"),
    ('{"turns_total": 1' + "0" * 5000 + "}", "it is not valid JSON"),  # past Python's digit limit
    ("[" * 100_000, "it is not valid JSON"),  # nested past the recursion limit
    ('{"turns": [', "it is not valid JSON"),
])
def test_numbers_and_nesting_json_allows_are_refused_by_name(text, expected):
    write_session("bad", text=text)
    with pytest.raises(PagecliError, match="cannot be read") as caught:
        sessions.load_session("bad")
    assert expected in str(caught.value)


def test_a_file_that_is_not_utf8_is_refused_and_lone_surrogates_in_json_become_replacement_characters():
    write_session("bytes", raw=b'{"system": "caf\xe9"}')
    with pytest.raises(PagecliError, match="it is not UTF-8 text"):
        sessions.load_session("bytes")
    write_session("escapes", text='{"system": "a\\ud800b", "turns": [{"user": "\\udcff", "assistant": "x"}]}')
    conversation = sessions.load_session("escapes").conversation
    assert conversation.system == "a\ufffdb" and conversation.turns[0].user == "\ufffd"


def test_resume_of_a_damaged_session_is_one_error_line_and_a_non_zero_exit(tiny_llama, capsys, monkeypatch):
    path = write_session("damaged", with_field("known_prefixes", "abc"))
    code, out, err = run_cli(cli_args(tiny_llama, "--resume", "damaged"), "hi\n", capsys, monkeypatch)
    assert code == 2 and out == ""
    assert err.strip() == (f"Error: Session file '{path}' cannot be read: 'known_prefixes' must be a JSON object "
                           "(got \"abc\"); move it away or pick another name.")


def test_load_of_a_damaged_session_in_a_live_chat_keeps_the_conversation(tiny_llama):
    write_session("damaged", with_field("turns_total", 1e300 * 1e300))  # json writes Infinity
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view, options=ChatOptions(session_name="mine"))
    chat.handle_line("first")
    assert chat.handle_line("/load damaged")
    assert "'turns_total' must be a whole number" in view.problems[-1] and "damaged.json" in view.problems[-1]
    assert [t.user for t in chat.conversation.turns] == ["first"] and chat.options.session_name == "mine"
    chat.handle_line("second")
    assert [t.user for t in chat.conversation.turns] == ["first", "second"]


def test_list_sessions_skips_a_damaged_file_and_says_which(capsys, monkeypatch):
    sessions.save_session("fine", Conversation(turns=[Turn("a", "b")], turns_total=1), "tiny")
    write_session("damaged", with_field("turns", 3))
    code, out, err = run_cli(["chat", "--list-sessions"], "", capsys, monkeypatch)
    assert code == 0
    assert out.split()[:3] == ["fine", "1", "turns"] and "damaged" not in out
    assert err.strip() == "Skipped damaged.json: 'turns' must be a list (got 3)."


def test_token_ids_past_the_vocabulary_are_dropped_with_a_notice_and_the_chat_works(tiny_llama):
    engine = make_engine(tiny_llama)
    vocab_size = engine.loaded.spec.vocab_size
    saved = Conversation(turns=[Turn("hi", "hello")], turns_total=1, fingerprint=engine.fingerprint,
                         known_prefixes=[KnownPrefix("<|im_start|>user\nhi", (1, vocab_size + 5))])
    sessions.save_session("edited", saved, "tiny")
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)
    chat.handle_line("/load edited")
    assert any("do not fit this model's vocabulary" in n for n in view.notices)
    assert chat.conversation.known_prefixes == []
    chat.handle_line("and now?")
    assert not view.problems and [t.user for t in chat.conversation.turns] == ["hi", "and now?"]


# --- any text saves ------------------------------------------------------------------------------------------
def test_save_writes_any_str_as_valid_utf8():
    conversation = Conversation(system="caf\udce9 \ud800", turns=[Turn("\udcff", "ok")], turns_total=1)
    path = sessions.save_session("odd", conversation, "tiny")
    json.loads(path.read_bytes().decode("utf-8"))  # strict: no surrogates reached the file
    loaded = sessions.load_session("odd").conversation
    assert loaded.system == "caf\ufffd \ufffd" and loaded.turns[0].user == "\ufffd"


def test_a_system_prompt_with_undecodable_bytes_chats_and_saves(tiny_llama, capsys, monkeypatch):
    system = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of --system $'caf\xe9 \xff'
    code, out, err = run_cli(cli_args(tiny_llama, "--system", system, "--session", "bytes", "--jsonl"),
                             "hi\n/save\n", capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["user"] == "hi"
    saved = json.loads((sessions_dir() / "bytes.json").read_bytes().decode("utf-8"))
    assert saved["system"] == "caf\ufffd \ufffd"


# --- one process at a time -----------------------------------------------------------------------------------
@pytest.fixture
def running_chat():
    """running_chat(args) -> a `pagecli chat --jsonl` process that has answered one message and waits for more
    (its stdin stays open); killed at the end."""
    children = []

    def start(args: list[str]) -> subprocess.Popen:
        code = "import sys, pagecli.cli.chat; from pagecli.cli import main; sys.exit(main(sys.argv[1:]))"
        child = subprocess.Popen([sys.executable, "-c", code, *args, "--jsonl"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ))
        children.append(child)
        child.stdin.write("hi\n")
        child.stdin.flush()
        assert json.loads(child.stdout.readline())["user"] == "hi"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_session_open_in_a_live_chat_is_refused_naming_its_process(tiny_llama, running_chat, capsys, monkeypatch):
    other = running_chat(cli_args(tiny_llama, "--session", "busy"))
    for option in ("--resume", "--session"):
        code, out, err = run_cli(cli_args(tiny_llama, option, "busy"), "hello\n", capsys, monkeypatch)
        assert code == 2 and out == ""
        assert err.strip() == (f"Error: Session 'busy' is open in another pagecli chat (process {other.pid}); leave "
                               "that chat first, or use another session name.")
    with pytest.raises(PagecliError, match=f"process {other.pid}"):
        sessions.save_session("busy", Conversation(), "tiny")

    other.send_signal(signal.SIGKILL)  # a killed chat leaves its lock file, and no lock
    other.wait()
    code, out, err = run_cli(cli_args(tiny_llama, "--resume", "busy", "--jsonl"), "hello\n", capsys, monkeypatch)
    assert code == 0, err
    assert [t["user"] for t in json.loads((sessions_dir() / "busy.json").read_text())["turns"]] == ["hi", "hello"]


def test_a_live_chat_cannot_save_into_a_session_another_chat_holds(tiny_llama, running_chat):
    other = running_chat(cli_args(tiny_llama, "--session", "theirs"))
    view = RecordingView()
    lock = sessions.lock_session("mine")
    chat = ChatController(make_engine(tiny_llama), GREEDY, view,
                          options=ChatOptions(session_name="mine", autosave=True), session_lock=lock)
    chat.handle_line("hello")
    chat.handle_line("/save theirs")
    assert f"process {other.pid}" in view.problems[-1]
    assert chat.options.session_name == "mine" and chat.session_lock is lock and lock.held
    chat.handle_line("/save other")  # autosave moves to 'other': its lock is held, 'mine' is let go
    assert chat.session_lock.name == "other" and not lock.held and (sessions_dir() / "other.json").is_file()
    chat.close()
    assert chat.session_lock is None
    with sessions.lock_session("other") as again:  # free again for anyone
        assert again.held


# --- any bytes -------------------------------------------------------------------------------------------
FIELD_PATHS = [("format",), ("system",), ("model",), ("updated",), ("turns",), ("turns", 0), ("turns", 0, "user"),
               ("turns", 0, "finish_reason"), ("turns_total",), ("known_prefixes",), ("known_prefixes", "fingerprint"),
               ("known_prefixes", "prefixes"), ("known_prefixes", "prefixes", 0),
               ("known_prefixes", "prefixes", 0, "token_ids"), ("known_prefixes", "prefixes", 0, "token_ids", 1)]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from([float("inf"), float("-inf"), float("nan"), 10**20, -1, "\ud800", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


def _with_value_at(path: tuple, value: object) -> bytes:
    """GOOD as JSON with the value at `path` (keys and list indexes) replaced."""
    data = copy.deepcopy(GOOD)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return json.dumps(data).encode()


SESSION_BYTES = (st.binary(max_size=200)
                 | st.builds(_with_value_at, st.sampled_from(FIELD_PATHS), JSON_VALUES)
                 | st.builds(lambda cut: json.dumps(GOOD).encode()[:cut], st.integers(0, 400)))


@settings(max_examples=400, deadline=None)
@given(SESSION_BYTES)
def test_any_bytes_as_a_session_file_load_or_fail_with_a_sentence(raw):
    path = write_session("fuzzed", raw=raw)
    try:
        session = sessions.load_session("fuzzed")
    except PagecliError as exc:
        message = str(exc)
        assert f"'{path}'" in message and "\n" not in message
        return
    conversation = session.conversation
    assert all(isinstance(t.user, str) and isinstance(t.assistant, str) for t in conversation.turns)
    assert isinstance(conversation.turns_total, int) and conversation.turns_total >= len(conversation.turns)
    for prefix in conversation.known_prefixes:
        assert all(type(t) is int and t >= 0 for t in prefix.token_ids)
    sessions.save_session("fuzzed", conversation, session.model)  # what loads, saves
