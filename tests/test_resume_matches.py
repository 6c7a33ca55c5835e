"""`generate` resumes only a results file that answers the same input and the same sampling settings.

Every record carries `line_sha256` (its input line) and `settings_sha256` (the run's sampling settings). A
results file or journal made from another input or with other settings is refused in one sentence naming
--force-restart and a new -o, and left byte-identical; records written before the stamps are kept only when
their ids match, with a note. The engine is EchoEngine (fake_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import echo_engine  # noqa: F401 - the fixture

from pagecli.cli import main


def generate(src: Path | str, dst: Path | str, *extra: str) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", "echo", *extra])


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("Error:")]


def test_every_record_says_which_line_and_settings_it_answers(echo_engine, tmp_path):
    dst = tmp_path / "r.out"
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), dst) == 0
    first, second = records(dst)
    assert first["line_sha256"] != second["line_sha256"]
    assert first["settings_sha256"] == second["settings_sha256"]
    assert list(first)[0] == "id", "a record still begins with its id"


def test_resuming_into_the_results_of_another_input_is_refused_and_the_file_left_as_it_was(
        echo_engine, tmp_path, capsys):
    """Reproducer: `generate a.jsonl -o r.out; generate b.jsonl -o r.out` said "Resuming: 2 of 3 requests
    already done" and kept a.jsonl's answers as b.jsonl's."""
    dst = tmp_path / "r.out"
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["apples", "pears"]), dst) == 0
    before = dst.read_bytes()
    capsys.readouterr()
    assert generate(write_jsonl(tmp_path / "b.jsonl", ["cars", "boats", "trains"]), dst) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "holds results of another run: its result for line 1 answers another request than line 1 of" in line
    assert "--force-restart" in line and "a new -o" in line
    assert dst.read_bytes() == before
    assert len(echo_engine.runs) == 1


def test_other_ids_no_longer_mean_nothing_to_do(echo_engine, tmp_path, capsys):
    """Reproducer: with other ids the second input got "Nothing to do"."""
    dst = tmp_path / "r.out"
    (tmp_path / "a.jsonl").write_text('{"id": "a1", "prompt": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"id": "b1", "prompt": "y"}\n')
    assert generate(tmp_path / "a.jsonl", dst) == 0
    assert generate(tmp_path / "b.jsonl", dst) == 2
    assert "holds results of another run" in error_lines(capsys.readouterr().err)[0]


def test_an_input_with_fewer_lines_than_the_results_is_refused(echo_engine, tmp_path, capsys):
    dst = tmp_path / "r.out"
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"]), dst) == 0
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["one"]), dst) == 2
    assert "has no request on line 2" in error_lines(capsys.readouterr().err)[0]


@pytest.mark.parametrize("flag", [["-t", "0.3"], ["--seed", "7"], ["--max-tokens", "9"], ["--stop", "x"]])
def test_resuming_with_other_sampling_settings_is_refused(echo_engine, tmp_path, capsys, flag):
    src, dst = write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), tmp_path / "r.out"
    assert generate(src, dst) == 0
    lines = dst.read_bytes().splitlines(keepends=True)
    dst.write_bytes(lines[0])  # half done
    assert generate(src, dst, *flag) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert "its results were made with other sampling settings than this run's" in line
    assert dst.read_bytes() == lines[0]


def test_retry_errors_does_not_mix_two_inputs(echo_engine, tmp_path, capsys):
    dst = tmp_path / "r.out"
    (tmp_path / "a.jsonl").write_text('{"prompt": "one"}\n{"prompt": ""}\n')
    assert generate(tmp_path / "a.jsonl", dst) == 0
    assert generate(write_jsonl(tmp_path / "b.jsonl", ["cars", "boats"]), dst, "--retry-errors") == 2
    assert "holds results of another run" in error_lines(capsys.readouterr().err)[0]


def test_a_journal_from_another_input_is_refused_too(echo_engine, tmp_path, capsys):
    src_a = write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"])
    dst = tmp_path / "r.out"
    assert generate(src_a, dst) == 0
    done = dst.read_bytes().splitlines(keepends=True)
    dst.write_bytes(done[0])
    journal = tmp_path / "r.out.pagecli-journal"
    journal.write_bytes(b'{"pagecli": "generate journal"}\n' + done[2])
    assert generate(write_jsonl(tmp_path / "b.jsonl", ["one", "two", "boats"]), dst) == 2
    assert "its result for line 3 answers another request" in error_lines(capsys.readouterr().err)[0]
    assert journal.exists() and dst.read_bytes() == done[0]


def test_force_restart_empties_the_results_and_answers_the_new_input(echo_engine, tmp_path):
    dst = tmp_path / "r.out"
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["apples", "pears"]), dst) == 0
    assert generate(write_jsonl(tmp_path / "b.jsonl", ["cars", "boats", "trains"]), dst, "--force-restart") == 0
    assert [r["text"] for r in records(dst)] == ["echo:cars", "echo:boats", "echo:trains"]
    assert echo_engine.runs[-1] == [1, 2, 3] or sorted(echo_engine.runs[-1]) == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "r.out"]


def test_force_restart_still_refuses_a_file_that_is_not_a_results_file(echo_engine, tmp_path, capsys):
    dst = tmp_path / "notes.txt"
    dst.write_text("my notes\n")
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["one"]), dst, "--force-restart") == 2
    assert "is not a pagecli results file" in error_lines(capsys.readouterr().err)[0]
    assert dst.read_text() == "my notes\n"


def test_the_same_input_under_another_name_resumes(echo_engine, tmp_path, capsys):
    """The path is not compared: a moved or copied input with the same lines resumes."""
    src, dst = write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), tmp_path / "r.out"
    assert generate(src, dst) == 0
    dst.write_bytes(dst.read_bytes().splitlines(keepends=True)[0])
    moved = src.rename(tmp_path / "moved.jsonl")
    assert generate(moved, dst) == 0
    assert "Resuming: 1 of 2 requests already done" in capsys.readouterr().err
    assert echo_engine.runs[-1] == [2]


def test_the_same_lines_read_as_text_instead_of_jsonl_are_another_input(echo_engine, tmp_path, capsys):
    src, dst = write_jsonl(tmp_path / "a.jsonl", ["one"]), tmp_path / "r.out"
    assert generate(src, dst) == 0
    assert generate(src, dst, "--format", "text") == 2
    assert "answers another request" in error_lines(capsys.readouterr().err)[0]


def older_record(line: int, request_id: str) -> str:
    return json.dumps({"id": request_id, "line": line, "text": "old", "finish_reason": "stop"})


def test_records_older_than_the_stamps_are_kept_when_their_ids_match_and_the_run_says_so(echo_engine, tmp_path,
                                                                                       capsys):
    src, dst = write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), tmp_path / "r.out"
    dst.write_text(older_record(1, "line-1") + "\n")
    assert generate(src, dst) == 0
    err = capsys.readouterr().err
    assert "1 results in" in err and "did not record their input" in err and "--force-restart" in err
    assert echo_engine.runs == [[2]]
    assert records(dst)[0]["text"] == "old"


def test_records_older_than_the_stamps_with_other_ids_are_refused(echo_engine, tmp_path, capsys):
    src, dst = write_jsonl(tmp_path / "a.jsonl", ["one", "two"]), tmp_path / "r.out"
    dst.write_text(older_record(1, "someone-else") + "\n")
    assert generate(src, dst) == 2
    assert "holds results of another run" in error_lines(capsys.readouterr().err)[0]


def test_force_restart_and_retry_errors_together_are_refused(echo_engine, tmp_path, capsys):
    assert generate(write_jsonl(tmp_path / "a.jsonl", ["one"]), tmp_path / "r.out", "--force-restart",
                    "--retry-errors") == 2
    assert "leave out --retry-errors" in error_lines(capsys.readouterr().err)[0]
