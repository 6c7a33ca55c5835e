"""`generate` touches only files it made: its lock and journal carry names no user file has by accident, are
created exclusively, are refused (and left as they are) when a file of that name is not pagecli's, never
are the input, and are gone after a clean run. The engine is EchoEngine (fake_engine.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_engine import echo_engine  # noqa: F401 - the fixture

from pagecli.cli import main


def generate(src: Path | str, dst: Path | str, *extra: str) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", "echo", *extra])


def prompts(tmp_path: Path, name: str = "in.txt", count: int = 3) -> Path:
    src = tmp_path / name
    src.write_text("".join(f"prompt {i}\n" for i in range(1, count + 1)))
    return src


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize("side", [".partial", ".lock"])
def test_an_input_named_like_an_older_side_file_of_the_output_is_read_and_never_touched(
        echo_engine, tmp_path, side):
    """Reproducers: `generate r.out.partial -o r.out` deleted its input; `generate q.out.lock -o q.out`
    overwrote it with a process id."""
    dst = tmp_path / "r.out"
    src = prompts(tmp_path, "r.out" + side)
    before = src.read_bytes()
    assert generate(src, dst) == 0
    assert src.read_bytes() == before
    assert [r["text"] for r in records(dst)] == ["echo:prompt 1", "echo:prompt 2", "echo:prompt 3"]


@pytest.mark.parametrize("side", [".partial", ".lock"])
def test_a_users_own_files_beside_the_output_are_left_alone(echo_engine, tmp_path, side):
    """Reproducer: a user's own x.out.partial was deleted and x.out.lock overwritten by `-o x.out`."""
    mine = tmp_path / ("x.out" + side)
    mine.write_text("my own notes\n")
    assert generate(prompts(tmp_path), tmp_path / "x.out") == 0
    assert mine.read_text() == "my own notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.txt", "x.out", mine.name])


@pytest.mark.parametrize("side", [".pagecli-journal", ".pagecli-lock"])
def test_the_input_at_a_side_files_own_name_is_refused_and_left_byte_identical(echo_engine, tmp_path, capsys,
                                                                               side):
    dst = tmp_path / "r.out"
    src = prompts(tmp_path, "r.out" + side)
    before = src.read_bytes()
    assert generate(src, dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "choose another -o" in line.lower()
    assert src.read_bytes() == before and not dst.exists()
    assert echo_engine.runs == []


@pytest.mark.parametrize("side, what", [(".pagecli-journal", "journal"), (".pagecli-lock", "lock file")])
def test_a_file_at_a_side_files_name_that_is_not_pagecli_s_is_refused_and_left_as_it_was(
        echo_engine, tmp_path, capsys, side, what):
    dst = tmp_path / "out.jsonl"
    stranger = tmp_path / ("out.jsonl" + side)
    stranger.write_bytes(b"someone else's data\n")
    assert generate(prompts(tmp_path), dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert f"'{stranger}' lies where pagecli keeps this output's {what}, but it is not pagecli's" in line
    assert stranger.read_bytes() == b"someone else's data\n"
    assert echo_engine.runs == []


@pytest.mark.parametrize("side", [".pagecli-journal", ".pagecli-lock"])
def test_a_symlink_at_a_side_files_name_is_never_followed(echo_engine, tmp_path, capsys, side):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (tmp_path / ("out.jsonl" + side)).symlink_to(target)
    assert generate(prompts(tmp_path), tmp_path / "out.jsonl") == 2
    assert "but it is not pagecli's" in error_lines(capsys.readouterr().err)[0]
    assert target.read_text() == "keep me\n"


def test_a_clean_run_after_records_waited_in_the_journal_leaves_only_the_output(echo_engine, tmp_path):
    """EchoEngine finishes the last line first: lines wait in the journal, which goes once they are placed."""
    assert generate(prompts(tmp_path, count=5), tmp_path / "out.jsonl") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.jsonl"]
    assert [r["line"] for r in records(tmp_path / "out.jsonl")] == [1, 2, 3, 4, 5]


def test_a_run_that_ends_with_an_error_removes_its_lock(echo_engine, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pagecli.batch.results_writer.append_line", refuse)
    assert generate(prompts(tmp_path), tmp_path / "out.jsonl") == 1
    assert not (tmp_path / "out.jsonl.pagecli-lock").exists()


def test_a_journal_left_by_a_killed_run_is_adopted_and_then_removed(echo_engine, tmp_path):
    """A journal pagecli wrote (its header line first) holds records finished ahead of their turn."""
    src, dst = prompts(tmp_path, count=3), tmp_path / "out.jsonl"
    assert generate(src, dst) == 0
    finished = dst.read_bytes().splitlines(keepends=True)
    dst.write_bytes(finished[0])
    journal = tmp_path / "out.jsonl.pagecli-journal"
    journal.write_bytes(b'{"pagecli": "generate journal"}\n' + finished[2])
    assert generate(src, dst) == 0
    assert echo_engine.runs[-1] == [2], "line 3 came from the journal"
    assert dst.read_bytes() == b"".join(finished)
    assert not journal.exists()


def test_the_lock_and_journal_are_created_exclusively(echo_engine, tmp_path, monkeypatch):
    """Every side file pagecli creates is opened with O_CREAT | O_EXCL (never an existing file adopted)."""
    created = []
    real_open = os.open

    def watching_open(path, flags, *args, **kwargs):
        if str(path).endswith((".pagecli-lock", ".pagecli-journal")) and flags & os.O_CREAT:
            created.append((Path(path).name, bool(flags & os.O_EXCL)))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watching_open)
    assert generate(prompts(tmp_path), tmp_path / "out.jsonl") == 0
    assert sorted(created) == [("out.jsonl.pagecli-journal", True), ("out.jsonl.pagecli-lock", True)]
