"""`generate`'s output file: pagecli writes only a file it owns, checks that before touching it, keeps
finished results through a kill, ends in input order, and says in one sentence when it cannot write.

These tests are about files, so the engine is EchoEngine (fake_engine.py), which finishes requests in
reverse input order; test_cli_generate.py and test_kill_and_resume.py run the real engine.
"""

from __future__ import annotations

import errno
import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest
from fake_engine import EchoEngine, echo_engine  # noqa: F401 - the fixture

import pagecli.batch.results_writer as results_writer
from pagecli.cli import main


def generate(src: Path | str, dst: Path | str, *extra: str) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", "echo", *extra])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def prompts(tmp_path: Path, count: int = 6) -> Path:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"prompt {i}\n" for i in range(1, count + 1)))
    return src


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Error:")]


def a_record(line: int, **fields) -> str:
    return json.dumps({"id": f"line-{line}", "line": line, **(fields or {"text": "x", "finish_reason": "stop"})})


# --- ownership: checked before anything is written, cut or appended ----------------------------------------
def test_the_output_may_not_be_the_input_by_any_path(echo_engine, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n')
    (tmp_path / "link.jsonl").symlink_to(src)
    for output in (src, tmp_path / "link.jsonl", tmp_path / "." / "in.jsonl"):
        assert generate(src, output) == 2
        assert "is the input file" in capsys.readouterr().err
    assert src.read_text() == '{"prompt": "hello"}\n'
    assert echo_engine.runs == []


@pytest.mark.parametrize("content, first_bad_line, problem", [
    (b'{"name": "my own data"}\n', 1, "is not a result record"),
    (a_record(1).encode() + b"\n\n" + a_record(2).encode() + b"\n", 2, "is blank"),
    (a_record(1).encode() + b"\nnot json\n" + b'{"id": "cut off', 2, "is not JSON"),
    (a_record(1).encode() + b'\n{"id": "line-2", "line": 2, "text": "caf\xe9", "finish_reason": "stop"}\n', 2,
     "is not UTF-8 text"),
    (json.dumps({"id": "a", "line": 1}).encode() + b"\n", 1, "is not a result record"),
    (json.dumps({"id": "a", "line": "1", "error": "x"}).encode() + b"\n", 1, "is not a result record"),
    (a_record(1).encode() + b"\nsome notes without a newline", 2, "is not a result record"),
    (b'{"id": "x", "user": "not a record, no newline"}', 1, "is not a result record"),
])
def test_a_file_that_is_not_a_results_file_is_refused_naming_the_line_and_left_byte_identical(
        content, first_bad_line, problem, echo_engine, tmp_path, capsys):
    dst = tmp_path / "out.jsonl"
    dst.write_bytes(content)
    assert generate(prompts(tmp_path), dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert f"its line {first_bad_line} {problem}" in line and "choose another -o" in line
    assert dst.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"], "no lock, no journal"
    assert echo_engine.runs == []


def test_a_results_file_with_a_cut_off_last_record_is_resumed_and_the_cut_line_redone(echo_engine, tmp_path):
    src, dst = prompts(tmp_path, 4), tmp_path / "out.jsonl"
    assert generate(src, dst) == 0
    complete = dst.read_bytes()
    whole = complete.splitlines(keepends=True)
    dst.write_bytes(b"".join(whole[:2]) + whole[2][:15])
    assert generate(src, dst) == 0
    assert dst.read_bytes() == complete
    assert echo_engine.runs[-1] == [3, 4]


def test_an_empty_output_file_is_ours(echo_engine, tmp_path):
    dst = tmp_path / "out.jsonl"
    dst.touch()
    assert generate(prompts(tmp_path, 2), dst) == 0
    assert [r["line"] for r in records(dst)] == [1, 2]


# --- finished results survive a kill; the file ends in input order ----------------------------------------
class Killed(BaseException):
    """The process dies here (a BaseException: nothing in pagecli catches it)."""


@pytest.mark.parametrize("dies_at_write", [1, 2, 4, 6, 7, 9])
def test_a_run_killed_mid_write_loses_only_what_was_in_flight(dies_at_write, echo_engine, tmp_path, monkeypatch):
    """EchoEngine finishes line 6 first and line 1 last: lines 6..2 wait in the journal, then 1..6 go to the
    output. The write `dies_at_write` is cut in half by a kill; a second run redoes only what no file holds."""
    src, dst = prompts(tmp_path, 6), tmp_path / "out.jsonl"
    real_append = results_writer.append_line
    writes = []

    def dies_mid_write(fd, data, name, regular):
        writes.append(data)
        if len(writes) == dies_at_write:
            os.write(fd, data[: len(data) // 2])
            raise Killed
        real_append(fd, data, name, regular)

    monkeypatch.setattr(results_writer, "append_line", dies_mid_write)
    with pytest.raises(Killed):
        generate(src, dst)
    saved = {json.loads(data)["line"] for data in writes[: dies_at_write - 1]}
    monkeypatch.setattr(results_writer, "append_line", real_append)

    assert generate(src, dst) == 0
    assert [r["line"] for r in records(dst)] == [1, 2, 3, 4, 5, 6]
    assert [r["text"] for r in records(dst)] == [f"echo:prompt {i}" for i in range(1, 7)]
    rerun = echo_engine.runs[1] if len(echo_engine.runs) > 1 else []
    assert sorted(rerun) == sorted({1, 2, 3, 4, 5, 6} - saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"], "no lock, no journal left"


def test_results_in_order_go_straight_to_the_output_and_leave_no_journal(echo_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(EchoEngine, "newest_first", False)
    src, dst = prompts(tmp_path, 3), tmp_path / "out.jsonl"
    files_written = []
    real_append = results_writer.append_line

    def append_line(fd, data, name, regular):
        files_written.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_append(fd, data, name, regular)

    monkeypatch.setattr(results_writer, "append_line", append_line)
    assert generate(src, dst) == 0
    assert files_written == [str(dst)] * 3
    assert [r["line"] for r in records(dst)] == [1, 2, 3]


def test_records_out_of_order_in_the_output_are_put_in_order(echo_engine, tmp_path):
    src, dst = prompts(tmp_path, 4), tmp_path / "out.jsonl"
    dst.write_text(a_record(3) + "\n" + a_record(1) + "\n")
    assert generate(src, dst) == 0
    assert [r["line"] for r in records(dst)] == [1, 2, 3, 4]
    assert echo_engine.runs == [[2, 4]]


# --- --retry-errors ---------------------------------------------------------------------------------------
def test_retry_errors_reruns_only_error_lines_and_replaces_their_records_in_place(echo_engine, tmp_path):
    src, dst = prompts(tmp_path, 4), tmp_path / "out.jsonl"
    before = [a_record(1), a_record(2, error="line 2: too long"), a_record(3), a_record(4, error="line 4: no")]
    dst.write_text("\n".join(before) + "\n")
    dst.chmod(0o640)
    assert generate(src, dst, "--retry-errors") == 0
    after = dst.read_text().splitlines()
    assert after[0] == before[0] and after[2] == before[2], "kept records are kept byte for byte"
    assert [json.loads(x)["text"] for x in (after[1], after[3])] == ["echo:prompt 2", "echo:prompt 4"]
    assert echo_engine.runs == [[2, 4]]
    assert dst.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"], "no lock, no journal left"


def test_without_retry_errors_error_records_are_kept(echo_engine, tmp_path, capsys):
    src, dst = prompts(tmp_path, 2), tmp_path / "out.jsonl"
    dst.write_text(a_record(1) + "\n" + a_record(2, error="line 2: no") + "\n")
    assert generate(src, dst) == 0
    assert "Nothing to do: all 2 requests" in capsys.readouterr().err
    assert generate(src, dst, "--retry-errors") == 0
    assert generate(src, dst, "--retry-errors") == 0
    assert "none of them an error" in capsys.readouterr().err
    assert echo_engine.runs == [[2]]


# --- smaller cases ----------------------------------------------------------------------------------------
def test_an_input_without_requests_says_so_and_writes_nothing(echo_engine, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("\n  \n\r\n")
    assert generate(src, tmp_path / "out.jsonl") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert f"There are no requests in '{src}'" in line
    assert not (tmp_path / "out.jsonl").exists()


def test_stdin_with_a_bom_is_read_as_jsonl(echo_engine, tmp_path, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b'\xef\xbb\xbf{"prompt": "hello"}\r\n{"prompt": "world"}\r\n'))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert generate("-", tmp_path / "out.jsonl") == 0
    assert [r["text"] for r in records(tmp_path / "out.jsonl")] == ["echo:hello", "echo:world"]


def test_stdout_gets_every_record_in_input_order(echo_engine, tmp_path, capsys):
    assert generate(prompts(tmp_path, 3), "-") == 0
    assert [json.loads(x)["line"] for x in capsys.readouterr().out.splitlines()] == [1, 2, 3]


def test_a_pipe_gets_every_record_in_input_order_without_a_lock_or_journal(echo_engine, tmp_path):
    fifo = tmp_path / "results.pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    assert generate(prompts(tmp_path, 3), fifo) == 0
    reader.join(timeout=30)
    assert [json.loads(x)["line"] for x in received[0].splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "results.pipe"]


# --- output I/O errors: one sentence, no half-written line --------------------------------------------------
def test_dev_full_is_one_sentence(echo_engine, tmp_path, capsys):
    assert generate(prompts(tmp_path, 2), "/dev/full") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "Cannot write results to '/dev/full': No space left on device." in line


def test_a_full_disk_is_one_sentence_and_leaves_whole_lines_then_the_rerun_finishes(echo_engine, tmp_path,
                                                                                    monkeypatch, capsys):
    src, dst = prompts(tmp_path, 6), tmp_path / "out.jsonl"
    real_write = os.write
    written = []

    def disk_fills(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            written.append(data)
            if len(written) == 9:  # the journal's header and lines 6..2 went to the journal, 1 and 2 to the output;
                # line 3 fills the disk
                real_write(fd, data[:10])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_fills)
    assert generate(src, dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "Cannot write results to" in line and "the disk is full" in line and "run the same command again" in line
    assert dst.read_bytes().endswith(b"\n") and [r["line"] for r in records(dst)] == [1, 2]
    monkeypatch.setattr(os, "write", real_write)
    assert generate(src, dst) == 0
    assert [r["line"] for r in records(dst)] == [1, 2, 3, 4, 5, 6]
    assert len(echo_engine.runs) == 1, "every result was saved before the disk filled: no engine the second time"


def test_a_directory_as_output_is_one_sentence(echo_engine, tmp_path, capsys):
    assert generate(prompts(tmp_path), tmp_path) == 2
    assert "is a directory; pass a file path" in error_lines(capsys.readouterr().err)[0]


def test_an_output_in_a_missing_folder_is_one_sentence(echo_engine, tmp_path, capsys):
    assert generate(prompts(tmp_path), tmp_path / "nope" / "out.jsonl") == 2
    [line] = error_lines(capsys.readouterr().err)
    assert f"the folder '{tmp_path / 'nope'}' does not exist" in line


@pytest.fixture
def read_only_folder(tmp_path, monkeypatch) -> Path:
    """A folder nothing can be created or written in (simulated: the tests run as root, who may write anywhere)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(folder)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    return folder


def test_a_complete_output_in_a_read_only_folder_has_nothing_to_do(echo_engine, tmp_path, read_only_folder, capsys):
    dst = read_only_folder / "out.jsonl"
    dst.write_text(a_record(1) + "\n" + a_record(2) + "\n")
    assert generate(prompts(tmp_path, 2), dst) == 0
    assert "Nothing to do: all 2 requests" in capsys.readouterr().err
    assert not (read_only_folder / "out.jsonl.pagecli-lock").exists()


def test_an_unfinished_output_in_a_read_only_folder_is_one_sentence(echo_engine, tmp_path, read_only_folder, capsys):
    dst = read_only_folder / "out.jsonl"
    dst.write_text(a_record(1) + "\n")
    assert generate(prompts(tmp_path, 2), dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "Permission denied" in line and "choose an -o in a folder you can write to" in line
    assert dst.read_text() == a_record(1) + "\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_really_read_only_folder_is_one_sentence(echo_engine, tmp_path, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        assert generate(prompts(tmp_path, 2), folder / "out.jsonl") == 2
        assert "choose an -o in a folder you can write to" in error_lines(capsys.readouterr().err)[0]
    finally:
        folder.chmod(0o755)
