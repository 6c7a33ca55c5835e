'''Multi-line messages: a block between two lines of """ is one message in plain mode and on the screen,
and on a terminal a paste with newlines (bracketed paste) is one message too.'''

from __future__ import annotations

import json
import os
import sys

import pytest
from chat_helpers import GREEDY, RecordingView, cli_args, make_engine, run_cli

from pagecli.chat.controller import ChatController
from pagecli.chat.multiline import BlockReader, Message, UnclosedBlock, read_entries
from pagecli.paths import sessions_dir

FENCE = '"""'


def test_a_block_is_one_message_with_its_newlines_and_blank_lines():
    lines = ["hi", FENCE, "line one", "", "  indented", FENCE, "/help", f"  {FENCE} ", "/not a command", FENCE]
    assert list(read_entries(lines)) == ["hi", Message("line one\n\n  indented"), "/help", Message("/not a command")]


def test_input_that_ends_inside_a_block_is_an_error_after_the_entries_before_it():
    entries = read_entries(["hi", FENCE, "never closed"])
    assert next(entries) == "hi"
    with pytest.raises(UnclosedBlock, match="ended inside a \"\"\" block"):
        next(entries)


def test_a_dropped_block_is_forgotten():
    reader = BlockReader()
    assert reader.feed(FENCE) is None and reader.in_block
    assert reader.feed("half typed") is None
    assert reader.drop_block() and not reader.in_block and not reader.drop_block()
    assert reader.feed("fresh") == "fresh"


def test_a_block_is_sent_as_a_message_even_when_it_starts_with_a_slash(tiny_llama):
    view = RecordingView()
    chat = ChatController(make_engine(tiny_llama), GREEDY, view)
    chat.run(read_entries([FENCE, "/help is not a command here", "second line", FENCE, FENCE, "  ", FENCE]))
    assert [t.user for t in chat.conversation.turns] == ["/help is not a command here\nsecond line"]
    assert view.help_rows is None and not view.problems  # the blank block sent nothing


def test_plain_mode_reads_blocks_from_stdin_and_reports_an_unclosed_one(tiny_llama, capsys, monkeypatch):
    text = f'hi\n{FENCE}\nline one\n\nline three\n{FENCE}\nbye\n{FENCE}\nunfinished\n'
    code, out, err = run_cli(cli_args(tiny_llama, "--jsonl"), text, capsys, monkeypatch)
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["user"] for r in records[:3]] == ["hi", "line one\n\nline three", "bye"]
    assert records[3] == {"error": 'The input ended inside a """ block; close it with a line holding only """. '
                                   "Its text was not sent."}
    assert code == 1 and len(records) == 4


def test_plain_mode_reads_blocks_from_an_input_file(tiny_llama, capsys, monkeypatch, tmp_path):
    messages = tmp_path / "messages.txt"
    messages.write_text(f"{FENCE}\r\nfirst\r\nsecond\r\n{FENCE}\r\n", encoding="utf-8")
    code, out, err = run_cli(cli_args(tiny_llama, "--input", str(messages), "--jsonl"), "", capsys, monkeypatch)
    assert code == 0, err
    assert [json.loads(line)["user"] for line in out.splitlines()] == ["first\nsecond"]


# --- a real terminal -----------------------------------------------------------------------------------------
def _become_terminal_session_leader() -> None:
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal test for Linux")
def test_on_the_screen_a_paste_and_a_block_are_one_message_each_and_ctrl_c_drops_a_block(tiny_llama):
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="110", LINES="40")
    code = "import sys, pagecli.cli.chat; from pagecli.cli import main; sys.exit(main(sys.argv[1:]))"
    child = subprocess.Popen([sys.executable, "-c", code, *cli_args(tiny_llama, "--session", "typed")],
                             stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                             start_new_session=True, preexec_fn=_become_terminal_session_leader)
    os.close(slave)
    seen = bytearray()

    def send_and_wait(keys: bytes, marker: bytes, timeout_s: float = 60, since: int | None = None) -> int:
        """Sends keys, waits for marker in what the screen shows from `since` on (by default what
        comes after the keys), and returns where the marker ends."""
        start = len(seen) if since is None else since
        os.write(master, keys)
        deadline = time.monotonic() + timeout_s
        while marker not in seen[start:]:
            assert time.monotonic() < deadline, f"no {marker!r} after {keys!r}; got {bytes(seen[-2000:])!r}"
            if select.select([master], [], [], 0.05)[0]:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    break
        return seen.index(marker, start) + len(marker)

    try:
        send_and_wait(b"", b"you>")
        send_and_wait(b"\x1b[200~pasted one\rpasted two\x1b[201~\r", b"you>")  # terminals send \r in a paste
        send_and_wait(b'"""\r', b"...>")
        send_and_wait(b"typed one\r", b"...>")
        time.sleep(0.5)  # a person's Ctrl-C comes after readline has taken the terminal, not with the prompt
        dropped = send_and_wait(b"\x03", b"Block dropped")  # Ctrl-C in a block drops it, and the chat stays
        send_and_wait(b"", b"you>", since=dropped)  # the prompt may come in the same read as the message
        send_and_wait(b'"""\rtyped two\r\rtyped four\r"""\r', b"you>")
        os.write(master, b"\x04")  # Ctrl-D leaves
        deadline = time.monotonic() + 30
        while child.poll() is None:
            assert time.monotonic() < deadline, f"chat did not leave; got {bytes(seen[-2000:])!r}"
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
    saved = json.loads((sessions_dir() / "typed.json").read_text(encoding="utf-8"))
    assert [t["user"] for t in saved["turns"]] == ["pasted one\npasted two", "typed two\n\ntyped four"]
    assert "Traceback" not in seen.decode("utf-8", "replace")
