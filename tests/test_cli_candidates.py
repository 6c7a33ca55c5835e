"""`pagecli generate` with n > 1 candidates: `choices` records, --n, resume, refused fields and commands."""

from __future__ import annotations

import json

import pytest

from pagecli.cli import main
from pagecli.batch.line_results import LineResults
from pagecli.engine.engine import RequestEvent
from test_cli_generate import generate, records

SEEDED = ["-t", "1", "--seed", "11"]


def test_a_line_with_n_gets_choices_and_a_line_without_keeps_todays_record(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "three", "prompt": "The quick brown fox", "n": 3}),
        json.dumps({"id": "one", "prompt": "The quick brown fox"}),
        json.dumps({"custom_id": "batch", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "Hello world!"}], "n": 2}}),
    ]) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    three, one, batch = records(tmp_path / "out.jsonl")
    assert set(one) == {"id", "line", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                        "line_sha256", "settings_sha256"}
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and [c["index"] for c in batch["choices"]] == [0, 1]
    for choice in three["choices"]:  # greedy: every candidate is the lone request's output
        assert set(choice) == {"index", "text", "finish_reason", "completion_tokens"}
        assert (choice["text"], choice["finish_reason"]) == (one["text"], one["finish_reason"])
    assert three["completion_tokens"] == 3 * one["completion_tokens"]
    assert three["prompt_tokens"] == one["prompt_tokens"] and "text" not in three


def test_the_n_flag_applies_to_every_line_and_seeded_candidate_i_is_seed_plus_i(tiny_llama, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("The quick brown fox\nHello world!\n")
    assert generate(tiny_llama, src, tmp_path / "many.jsonl", *SEEDED, "--n", "3") == 0
    many = records(tmp_path / "many.jsonl")
    assert [len(r["choices"]) for r in many] == [3, 3]
    for i in range(3):
        assert generate(tiny_llama, src, tmp_path / f"lone{i}.jsonl", "-t", "1", "--seed", str(11 + i)) == 0
        lone = records(tmp_path / f"lone{i}.jsonl")
        assert [r["choices"][i]["text"] for r in many] == [r["text"] for r in lone]


def test_resume_keeps_whole_choices_records_and_reruns_the_cut_one(tiny_llama, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\n")
    dst = tmp_path / "out.jsonl"
    assert generate(tiny_llama, src, dst, "--n", "2") == 0
    complete = dst.read_text().splitlines(keepends=True)
    dst.write_text(complete[0] + complete[1][:40])  # killed while writing line 2's record
    assert generate(tiny_llama, src, dst, "--n", "2") == 0
    assert dst.read_text() == "".join(complete)


@pytest.mark.parametrize("field, value", [("logprobs", True), ("logprobs", 0), ("top_logprobs", 3), ("best_of", 2)])
def test_unsupported_fields_are_the_lines_error_never_dropped(tiny_llama, tmp_path, field, value):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "fox", field: value}) + "\n" + json.dumps({"prompt": "fox"}) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    bad, good = records(tmp_path / "out.jsonl")
    assert bad["error"].startswith(f"line 1: '{field}' is not supported") and "text" in good


@pytest.mark.parametrize("field, value", [("logprobs", False), ("logprobs", None), ("best_of", 1), ("top_logprobs", 0)])
def test_unsupported_fields_that_ask_for_nothing_are_accepted(tiny_llama, tmp_path, field, value):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "fox", field: value}) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    assert "text" in records(tmp_path / "out.jsonl")[0]


@pytest.mark.parametrize("value, message", [(0, "n must be between 1 and 256"), ("2", "'n' must be an integer"),
                                            (1.5, "'n' must be an integer")])
def test_a_bad_n_is_the_lines_error(tiny_llama, tmp_path, value, message):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "fox", "n": value}) + "\n" + json.dumps({"prompt": "fox"}) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    bad, good = records(tmp_path / "out.jsonl")
    assert bad["error"].startswith("line 1: ") and message in bad["error"] and "text" in good


@pytest.mark.parametrize("command", [["chat", "--input", "-"], ["bench", "run"]])
def test_commands_that_show_one_completion_refuse_n(tiny_llama, command, capsys):
    assert main([*command, "-m", str(tiny_llama), "--n", "2"]) != 0
    assert "parallel sampling" in capsys.readouterr().err


def test_a_record_waits_for_the_last_candidate():
    results = LineResults()
    results.expect(4, "x", 2)

    def event(index: int, text: str, finished: bool) -> RequestEvent:
        return RequestEvent("4", text, (1,), finished, "length" if finished else None, 3, 1, 0, None, index)

    assert results.add(4, event(1, "b", True)) is None
    record = results.add(4, event(0, "a", True))
    assert [c["text"] for c in record["choices"]] == ["a", "b"]


def test_the_run_summary_says_what_sharing_saved_only_when_lines_forked(tiny_llama, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("The quick brown fox jumps over the lazy dog.\n")
    assert generate(tiny_llama, src, tmp_path / "one.jsonl") == 0
    assert "saved" not in capsys.readouterr().err
    assert generate(tiny_llama, src, tmp_path / "many.jsonl", "--n", "4", "--block-size", "4") == 0
    summary = capsys.readouterr().err
    assert "candidates shared" in summary and "blocks saved" in summary


def test_a_bench_workload_file_with_n_is_refused_naming_the_line(tmp_path):
    from pagecli.cli.bench import file_workload
    from pagecli.config import SamplingParams
    from pagecli.errors import PagecliError

    src = tmp_path / "work.jsonl"
    src.write_text(json.dumps({"prompt": "fox"}) + "\n" + json.dumps({"prompt": "fox", "n": 4}) + "\n")
    with pytest.raises(PagecliError, match="line 2 .* asks for n 4"):
        file_workload(str(src), SamplingParams(), None, None)
