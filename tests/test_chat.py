"""Chat: prefix reuse across turns, slash commands, sessions, truncation, Ctrl-C, plain and terminal modes."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch
from chat_helpers import BLOCK_SIZE, GREEDY, RecordingView, cli_args, make_engine, run_cli

from pagecli.chat import session as sessions
from pagecli.chat.controller import ChatController, ChatOptions
from pagecli.chat.conversation import Conversation, Turn
from pagecli.chat.prompt import PromptBuilder
from pagecli.chat.turn import TurnTracker, run_turn
from pagecli.config import SamplingParams
from pagecli.engine import Engine
from pagecli.errors import PagecliError
from pagecli.paths import sessions_dir

MESSAGES = [
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "def main(): print('hello')",
    "Très bien, merci.",
    "What does the block pool look like now?",
]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Engines here run on one thread (tiny models: more threads only contend); put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def record_events(engine: Engine) -> list:
    """Spy on engine.step so a test can read the RequestEvents the chat loop consumed."""
    events: list = []
    step = engine.step

    def spying_step():
        produced = step()
        events.extend(produced)
        return produced

    engine.step = spying_step
    return events


# --- prefix reuse across turns -----------------------------------------------------------------------------
def test_chat_turn_two_onwards_prefills_only_the_new_message(tiny_llama):
    engine = make_engine(tiny_llama)
    events = record_events(engine)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view, Conversation(system="You are a terse assistant."))
    for message in MESSAGES:
        assert chat.handle_line(message)
    assert not view.problems
    records = [r for r in view.records if r is not None]
    assert len(records) == len(MESSAGES)
    finished = [e for e in events if e.finished]
    builder = PromptBuilder(engine)
    for previous, record, event in zip(records, records[1:], finished[1:]):
        turn = record.result.stats
        # Everything the previous turn computed (prompt + reply, less the last sampled token) is history
        # now; all of its full blocks come from the cache, exactly.
        history_computed = previous.result.stats.prompt_tokens + previous.result.stats.completion_tokens - 1
        assert turn.cached_tokens == history_computed // BLOCK_SIZE * BLOCK_SIZE
        assert turn.cached_disk_tokens == 0  # within one process the pool serves everything
        assert turn.cached_tokens == event.cached_tokens  # the engine's own per-request figure agrees
        assert turn.prefilled_tokens == turn.prompt_tokens - turn.cached_tokens
        # What is new on this turn: the end of the previous reply, the new message, the template glue.
        new_part = f"<|im_end|>\n<|im_start|>user\n{record.user}<|im_end|>\n<|im_start|>assistant\n"
        new_tokens = len(builder.tokenize(new_part))
        assert new_tokens <= turn.prefilled_tokens <= new_tokens + BLOCK_SIZE  # + the history's partial block
    last = records[-1].result.stats
    assert last.prefilled_tokens < last.prompt_tokens / 2


def test_without_prefix_caching_every_turn_prefills_everything(tiny_llama):
    engine = make_engine(tiny_llama, enable_prefix_caching=False)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)
    for message in MESSAGES[:3]:
        chat.handle_line(message)
    for record in view.records:
        assert record.result.stats.cached_tokens == 0
        assert record.result.stats.prefilled_tokens == record.result.stats.prompt_tokens


# --- slash commands ------------------------------------------------------------------------------------------
def test_slash_commands_do_what_they_say(tiny_llama):
    engine = make_engine(tiny_llama)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)

    chat.handle_line("/help")
    assert [usage.split()[0] for usage, _ in view.help_rows] == [
        "/help", "/system", "/reset", "/retry", "/undo", "/save", "/load", "/stats", "/pool", "/set", "/format", "/lora",
        "/exit"]
    chat.handle_line("/system Answer in one word.")
    assert chat.conversation.system == "Answer in one word."
    chat.handle_line("/set temperature=0 max_tokens=3 seed=7 top_p=0.9")
    assert (chat.sampling.temperature, chat.sampling.max_tokens, chat.sampling.seed, chat.sampling.top_p) == (
        0, 3, 7, 0.9)
    chat.handle_line("hello")
    assert view.records[-1].result.stats.completion_tokens <= 3
    chat.handle_line("/stats")
    assert view.stats_shown[-1].tokens_generated >= 1
    chat.handle_line("/pool")
    assert view.notices[-1] == "pool toggled"
    chat.handle_line("//slash at the start")
    assert chat.conversation.turns[-1].user == "/slash at the start"
    chat.handle_line("/reset")
    assert chat.conversation.turns == [] and chat.conversation.system == "Answer in one word."
    chat.handle_line("/system -")
    assert chat.conversation.system is None

    assert not view.problems
    chat.handle_line("/sav")
    assert view.problems[-1] == "Unknown command '/sav'; did you mean /save? Type /help for the list."
    chat.handle_line("/frobnicate")
    assert view.problems[-1] == "Unknown command '/frobnicate'. Type /help for the list."
    chat.handle_line("/set bogus=1")
    assert "Cannot set 'bogus'" in view.problems[-1]
    chat.handle_line("/set temperature=hot")
    assert view.problems[-1] == "temperature must be a number (got 'hot')."
    chat.handle_line("/set top_p=2")
    assert "top_p must be in (0, 1]" in view.problems[-1]
    chat.handle_line("/load")
    assert view.problems[-1].startswith("Usage: /load NAME")
    assert chat.sampling.top_p == 0.9  # a rejected /set changes nothing
    assert chat.handle_line("/exit") is False
    assert chat.handle_line("/quit") is False


# --- Ctrl-C -------------------------------------------------------------------------------------------------
def test_stop_hook_aborts_the_reply_and_the_engine_stays_usable(tiny_llama):
    engine = make_engine(tiny_llama)
    builder = PromptBuilder(engine)
    prompt = builder.build(Conversation().messages("Tell me a long story."))
    sampling = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    tracker = TurnTracker(engine, len(prompt.token_ids))
    result = run_turn(engine, prompt.token_ids, sampling, tracker, should_stop=lambda: tracker.completion_tokens >= 3)
    assert result.finish_reason == "abort"
    assert len(result.token_ids) == 3
    assert not engine.has_unfinished
    engine.pool.check_invariants()
    stats = engine.stats()
    assert stats.blocks_active == 0 and stats.blocks_cached >= 1  # the prompt's full blocks stay findable


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_conversation(tiny_llama):
    engine = make_engine(tiny_llama)
    pieces = []

    def press_ctrl_c_after_two_pieces(delta):
        pieces.append(delta)
        if len(pieces) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled by the chat's SIGINT flag, not KeyboardInterrupt

    view = RecordingView(on_text=press_ctrl_c_after_two_pieces)
    chat = ChatController(engine, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), view)
    chat.handle_line("first message")
    stopped = view.records[-1]
    assert stopped.result.finish_reason == "abort"
    assert 2 <= stopped.result.stats.completion_tokens < 60
    assert chat.conversation.turns[-1].finish_reason == "abort"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back

    view.on_text = None
    chat.sampling = GREEDY
    chat.handle_line("second message")
    assert [t.user for t in chat.conversation.turns] == ["first message", "second message"]
    assert view.records[-1].result.stats.cached_tokens >= BLOCK_SIZE  # the stopped turn's blocks are reused
    engine.pool.check_invariants()


# --- truncation --------------------------------------------------------------------------------------------
def test_long_conversation_drops_oldest_turns_and_keeps_the_system_prompt(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=160)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view, Conversation(system="Be brief."))
    for i in range(12):
        chat.handle_line(f"message {i}: {MESSAGES[i % len(MESSAGES)]}")
    assert not view.problems
    assert any("dropped the oldest" in n for n in view.notices)
    assert chat.conversation.system == "Be brief."
    kept = [t.user for t in chat.conversation.turns]
    assert kept[-1].startswith("message 11:") and len(kept) < 12
    assert kept == [f"message {i}: {MESSAGES[i % len(MESSAGES)]}" for i in range(12 - len(kept), 12)]
    assert chat.conversation.turns_total == 12
    assert all(r.result.stats.prompt_tokens <= engine.max_model_len - 8 for r in view.records)


def test_no_truncate_refuses_the_message_with_one_sentence(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=160)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view, options=ChatOptions(truncate=False))
    for i in range(12):
        assert chat.handle_line(f"message {i}: {MESSAGES[i % len(MESSAGES)]}")
    assert view.problems, "the conversation should have outgrown 160 tokens"
    assert "--no-truncate" in view.problems[0] and "\n" not in view.problems[0]
    assert chat.conversation.turns[0].user.startswith("message 0:")  # nothing was dropped
    assert len(chat.conversation.turns) + len(view.problems) == 12


def test_a_message_longer_than_the_context_is_an_error_and_the_chat_goes_on(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view)
    assert chat.handle_line("word " * 200)
    assert view.problems[-1].startswith("This message is too long")
    chat.handle_line("short")
    assert [t.user for t in chat.conversation.turns] == ["short"]


# --- sessions ---------------------------------------------------------------------------------------------
def test_save_and_load_round_trip_keeps_turns_and_token_ids(tiny_llama):
    engine = make_engine(tiny_llama)
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view, Conversation(system="sys"), ChatOptions(model_name="tiny"))
    chat.handle_line("one")
    chat.handle_line("two")
    chat.handle_line("/save mine")
    path = sessions_dir() / "mine.json"
    files = [p.name for p in sessions_dir().iterdir() if p.is_file()]
    assert path.is_file() and files == ["mine.json"]  # no temp files left

    fresh = ChatController(make_engine(tiny_llama), GREEDY, RecordingView())
    fresh.handle_line("/load mine")
    assert fresh.conversation.system == "sys"
    assert [(t.user, t.assistant) for t in fresh.conversation.turns] == [
        (t.user, t.assistant) for t in chat.conversation.turns]
    assert fresh.conversation.known_prefixes == chat.conversation.known_prefixes
    # The loaded token ids give the next prompt the same ids as in the first process.
    next_messages = chat.conversation.messages("three")
    builder = PromptBuilder(engine)
    assert builder.build(next_messages, fresh.conversation.prefixes_for(engine.fingerprint)).token_ids == (
        builder.build(next_messages, chat.conversation.prefixes_for(engine.fingerprint)).token_ids)

    fresh.handle_line("/load nothing-here")
    assert "No session named 'nothing-here'" in fresh.view.problems[-1]
    fresh.handle_line("/save ../escape")
    assert "is not a session name" in fresh.view.problems[-1]


def test_a_corrupt_session_file_is_reported_not_raised(tiny_llama):
    sessions_dir().mkdir(parents=True, exist_ok=True)
    (sessions_dir() / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(PagecliError, match="cannot be read"):
        sessions.load_session("broken")
    listing = sessions.list_sessions()
    assert listing.sessions == [] and listing.skipped[0].startswith("Skipped broken.json: it is not valid JSON")


def test_session_autosaves_every_turn_and_resume_continues(tiny_llama, capsys, monkeypatch):
    code, out, err = run_cli(cli_args(tiny_llama, "--session", "trip", "--jsonl", "--system", "sys"),
                             "hi\nbye\n", capsys, monkeypatch)
    assert code == 0, err
    saved = json.loads((sessions_dir() / "trip.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["hi", "bye"] and saved["system"] == "sys"

    code, out, err = run_cli(cli_args(tiny_llama, "--session", "trip"), "", capsys, monkeypatch)
    assert code == 2 and "exists; continue it with --resume trip" in err

    code, out, err = run_cli(cli_args(tiny_llama, "--resume", "trip", "--jsonl"), "again\n", capsys, monkeypatch)
    assert code == 0, err
    record = json.loads(out.splitlines()[-1])
    assert record["turn"] == 3 and record["user"] == "again"
    if hasattr(Engine, "persist_prefix"):  # the disk prefix store: the history comes from disk, not prefill
        assert record["cached_disk_tokens"] >= BLOCK_SIZE
        assert record["prefilled_tokens"] < record["prompt_tokens"] - record["cached_disk_tokens"] + 2 * BLOCK_SIZE
    saved = json.loads((sessions_dir() / "trip.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["hi", "bye", "again"]

    code, out, err = run_cli(["chat", "--list-sessions"], "", capsys, monkeypatch)
    assert code == 0 and out.split()[:3] == ["trip", "3", "turns"]

    code, out, err = run_cli(cli_args(tiny_llama, "--resume", "missing"), "", capsys, monkeypatch)
    assert code == 2 and "No session named 'missing'" in err and "Traceback" not in err


# --- plain mode end to end ----------------------------------------------------------------------------------
def test_plain_mode_prints_two_replies_and_exits_zero(tiny_llama, capsys, monkeypatch):
    code, out, err = run_cli(cli_args(tiny_llama), "hi\n\nbye\n", capsys, monkeypatch)
    assert code == 0, err
    assert out.endswith("\n") and out.count("\n") >= 2
    assert "\x1b[" not in out  # no colours in plain mode


def test_plain_mode_jsonl_records_carry_per_turn_stats(tiny_llama, capsys, monkeypatch, tmp_path):
    messages = tmp_path / "messages.txt"
    messages.write_text("hi\nbye\n/stats\n/nope\nthird one\n", encoding="utf-8")
    code, out, err = run_cli(cli_args(tiny_llama, "--input", str(messages), "--jsonl"), "", capsys, monkeypatch)
    records = [json.loads(line) for line in out.splitlines()]
    turns = [r for r in records if "turn" in r]
    assert [t["user"] for t in turns] == ["hi", "bye", "third one"]
    assert code == 1  # the unknown command counts as a problem for scripts
    assert {"error": "Unknown command '/nope'. Type /help for the list."} in records
    assert any("stats" in r and "turn" not in r for r in records)
    for previous, turn in zip(turns, turns[1:]):
        assert turn["cached_tokens"] == (previous["prompt_tokens"] + previous["completion_tokens"] - 1) // 16 * 16
        assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
        assert turn["stats"]["prefix_hit_tokens"] >= turn["cached_tokens"]
    assert turns[0]["cached_disk_tokens"] == 0 and turns[0]["ttft_s"] > 0


def test_plain_mode_no_truncate_error_exits_non_zero(tiny_llama, capsys, monkeypatch):
    lines = "".join(f"message {i}: {MESSAGES[i % len(MESSAGES)]}\n" for i in range(12))
    code, out, err = run_cli(cli_args(tiny_llama, "--max-model-len", "160", "--no-truncate", "--jsonl"), lines,
                             capsys, monkeypatch)
    assert code == 1
    errors = [json.loads(line) for line in out.splitlines() if '"error"' in line]
    assert errors and "--no-truncate" in errors[0]["error"]


# --- a real terminal ----------------------------------------------------------------------------------------
def _become_terminal_session_leader() -> None:
    """In the child: own the pseudo-terminal, so Ctrl-C typed into it sends SIGINT as in a real terminal."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal test for Linux")
def test_terminal_chat_streams_replies_with_the_pool_panel_and_ctrl_c_stops_one(tiny_model_factory):
    import pty
    import select
    import subprocess
    import time

    # A long context, so the reply that Ctrl-C stops cannot finish first on a fast machine.
    folder = tiny_model_factory("llama", max_position_embeddings=4096)
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="110", LINES="40")
    code = "import sys, pagecli.cli.chat; from pagecli.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [*cli_args(folder, "--ignore-eos"), "--num-blocks", "300"]  # the last --num-blocks wins
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdin=slave,
                             stdout=slave, stderr=slave, env=env, close_fds=True, start_new_session=True,
                             preexec_fn=_become_terminal_session_leader)
    os.close(slave)
    seen = bytearray()

    def send_and_wait(keys: bytes, marker: bytes, timeout_s: float = 60) -> None:
        """Type keys, then read until marker shows up in what the terminal printed after them."""
        start = len(seen)
        os.write(master, keys)
        deadline = time.monotonic() + timeout_s
        while marker not in seen[start:]:
            assert time.monotonic() < deadline, f"no {marker!r} after {keys!r}; got {bytes(seen[-2000:])!r}"
            if select.select([master], [], [], 0.05)[0]:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    break

    try:
        send_and_wait(b"", b"you>")
        send_and_wait(b"hello there\r", b"you>")
        send_and_wait(b"second message\r", b"you>")
        send_and_wait(b"/set max_tokens=4000\r", b"you>")
        send_and_wait(b"a long one please\r", b"KV block pool")  # the live panel is up: the reply streams
        send_and_wait(b"\x03", b"[stopped]")  # Ctrl-C stops the reply ...
        if b"you>" not in seen[seen.rindex(b"[stopped]"):]:
            send_and_wait(b"", b"you>")
        # ... and at the prompt it leaves. CPython's readline misses a SIGINT that lands in the instant
        # between drawing the prompt and waiting for a key, so press again if needed, as a person would.
        deadline = time.monotonic() + 30
        next_press = time.monotonic() + 0.2
        while child.poll() is None:  # keep reading, so the child never blocks on a full terminal
            assert time.monotonic() < deadline, f"chat did not leave; got {bytes(seen[-2000:])!r}"
            if time.monotonic() >= next_press:
                os.write(master, b"\x03")
                next_press += 2
            if select.select([master], [], [], 0.05)[0]:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    pass
        assert child.returncode == 0
    finally:
        if child.poll() is None:
            child.kill()
        os.close(master)
    text = seen.decode("utf-8", "replace")
    assert text.count("assistant") >= 3
    assert "KV block pool" in text and "cached" in text and "tokens still fit" in text
    assert "turn: prompt" in text and "Traceback" not in text and "Interrupted" not in text


# --- templates that re-render history differently -----------------------------------------------------------
SHORTENING_TEMPLATE = (  # like templates that strip earlier reasoning: past replies come back changed
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "shortening", "none"])
def test_reuse_is_the_longest_matching_block_prefix_and_reported_honestly(tiny_llama, template):
    engine = make_engine(tiny_llama)
    if template == "shortening":
        engine.tokenizer.chat_template = SHORTENING_TEMPLATE
    elif template == "none":
        engine.chat_template = None  # the engine's plain "role: content" rendering
    builder = PromptBuilder(engine)
    conversation = Conversation(system="sys")
    # ignore_eos lets end-of-turn tokens appear inside replies, which the rendered text leaves out.
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    previous_computed: list[int] = []
    for message in MESSAGES[:3]:
        prompt = builder.build(conversation.messages(message), conversation.known_prefixes)
        result = run_turn(engine, prompt.token_ids, sampling, TurnTracker(engine, len(prompt.token_ids)))
        common = 0
        for a, b in zip(previous_computed, prompt.token_ids):
            if a != b:
                break
            common += 1
        expected = min(common, len(prompt.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert result.stats.cached_tokens == expected
        assert result.stats.prefilled_tokens == result.stats.prompt_tokens - expected
        computed = len(prompt.token_ids) + result.stats.completion_tokens - 1
        previous_computed = list(prompt.token_ids + result.token_ids)[:computed]
        conversation.add_turn(Turn(message, result.text, result.finish_reason))
        conversation.remember(builder.prefixes_after_reply(prompt, result.text, result.token_ids), "fp")


def test_a_template_that_rejects_the_conversation_gives_a_hint_not_a_crash(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + engine.tokenizer.chat_template
    )
    view = RecordingView()
    chat = ChatController(engine, GREEDY, view, Conversation(system="sys"))
    assert chat.handle_line("hello")
    assert "System role not supported" in view.problems[-1] and "/system -" in view.problems[-1]
    chat.handle_line("/system -")
    chat.handle_line("hello")
    assert [t.user for t in chat.conversation.turns] == ["hello"]
