"""`pagecli generate`: input formats, ordered output, resume, bad lines, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagecli.cli import main

GREEDY = ["-t", "0", "-n", "6", "--ignore-eos"]


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def generate(model, src, dst, *extra) -> int:
    return main(["generate", str(src), "-o", str(dst), "-m", str(model), *GREEDY, *extra])


def test_jsonl_prompt_and_messages_with_ids_in_input_order(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "long", "prompt": "Paged attention keeps the KV cache in fixed-size blocks. " * 4},
        {"id": 7, "messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 2},
        {"prompt": "fox"},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    out = records(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == ["long", "7", "line-3"]
    assert [r["line"] for r in out] == [1, 2, 3]
    assert out[1]["completion_tokens"] == 2 and out[1]["finish_reason"] == "length"
    assert out[0]["completion_tokens"] == 6
    assert all(isinstance(r["text"], str) and r["prompt_tokens"] > 0 for r in out)


def test_openai_batch_request_lines(tiny_llama, tmp_path):
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps({"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "x", "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 3, "temperature": 0}}) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    [rec] = records(tmp_path / "out.jsonl")
    assert rec["id"] == "req-1" and rec["completion_tokens"] == 3


def test_openai_content_parts_and_max_completion_tokens_are_accepted_and_images_refused(tiny_llama, tmp_path):
    src = tmp_path / "batch.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}], "max_completion_tokens": 2},
        {"custom_id": "img", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}},
        {"custom_id": "legacy", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello", "max_completion_tokens": 3}},
        {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {"prompt": "Hello"}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "Hello"}},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    parts, image, legacy, get, embeddings = records(tmp_path / "out.jsonl")
    assert parts["completion_tokens"] == 2 and legacy["completion_tokens"] == 3
    assert image["id"] == "img" and "'image_url' part; this model takes text only" in image["error"]
    assert get["error"] == 'line 4: \'method\' must be POST for a batch request (got "GET")'
    assert "'url' \"/v1/embeddings\" is not an endpoint pagecli answers" in embeddings["error"]


def test_lines_end_at_newline_only_with_crlf_and_a_bom_accepted(tiny_llama, tmp_path):
    """U+2028, U+2029, U+0085 and a form feed inside a line do not end it (str.splitlines() would)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + "\r\n".join([
        json.dumps({"prompt": "one\u2028two\u2029three\x85four"}, ensure_ascii=False),
        '{"prompt": "form\x0cfeed"}',
        json.dumps({"id": "last", "prompt": "fox"}),
    ]).encode() + b"\r\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    first, form_feed, last = records(tmp_path / "out.jsonl")
    assert first["line"] == 1 and first["completion_tokens"] == 6
    assert form_feed["error"].startswith("line 2: invalid JSON (Invalid control character")
    assert form_feed["error"].endswith("(Invalid control character at column 17)")  # once "at at column"
    assert (last["line"], last["id"]) == (3, "last")


def test_plain_text_one_prompt_per_line_skips_blank_lines(tiny_llama, tmp_path):
    src = tmp_path / "prompts.txt"
    src.write_text("Hello world\n\nThe quick brown fox\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    assert [r["line"] for r in records(tmp_path / "out.jsonl")] == [1, 3]


def test_bad_lines_become_error_records_and_the_rest_still_runs(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        '{"prompt": "ok one"}',
        "{not json",
        '{"prompt": ""}',
        '{"prompt": 5}',
        '{"prompt": "ok", "temperature": -1}',
        '{"prompt": "ok", "max_tokens": "many"}',
        '{"text": "no prompt"}',
        json.dumps({"prompt": "fox " * 600}),  # longer than the context (512)
        '{"prompt": "ok two"}',
    ]) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    out = records(tmp_path / "out.jsonl")
    assert [r["line"] for r in out] == list(range(1, 10))
    errors = {r["line"]: r["error"] for r in out if "error" in r}
    assert set(errors) == {2, 3, 4, 5, 6, 7, 8}
    assert "invalid JSON" in errors[2] and "empty" in errors[3] and "must be a string" in errors[4]
    assert "temperature" in errors[5] and "max_tokens" in errors[6] and "prompt" in errors[7]
    assert "tokens" in errors[8]
    assert all(e.startswith(f"line {n}:") for n, e in errors.items())
    assert "text" in out[0] and "text" in out[8]


def test_rerun_resumes_and_drops_a_half_written_line(tiny_llama, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\nfour\n")
    dst = tmp_path / "out.jsonl"
    assert generate(tiny_llama, src, dst) == 0
    complete = dst.read_text().splitlines(keepends=True)
    # A run killed while writing line 3: two whole records and half of the third.
    dst.write_text(complete[0] + complete[1] + complete[2][:10])
    assert generate(tiny_llama, src, dst) == 0
    assert dst.read_text() == "".join(complete)  # greedy: the resumed lines equal the first run's


def test_stdin_to_stdout(tiny_llama, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pagecli", "generate", "-", "-o", "-", "-m", str(tiny_llama), *GREEDY],
        input="hello\nworld\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [r["line"] for r in lines] == [1, 2]
    assert "Done: 2 completions" in proc.stderr


def test_output_to_dev_null_runs_and_counts_every_result(tiny_llama, tmp_path, capsys):
    # /dev/null refuses fsync (EINVAL) and has nothing to resume from; it used to end in
    # "Unexpected OSError".
    src = tmp_path / "in.txt"
    src.write_text("hello\nworld\n")
    assert generate(tiny_llama, src, os.devnull) == 0
    assert "Done: 2 completions, 0 errors" in capsys.readouterr().err


@pytest.mark.parametrize("args, message, code", [
    (["-m", "/no/such/model"], "does not exist", 3),
    (["--profile", "nope"], "Unknown profile 'nope'", 2),
    (["--temperature", "-1"], "temperature must be 0 or more", 2),
    (["--attention", "cuda-magic"], "attention must be one of", 2),
])
def test_user_errors_are_one_line_with_an_exit_code(args, message, code, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    rc = main(["generate", str(src), "-o", str(tmp_path / "o.jsonl"), *args])
    err = capsys.readouterr().err
    assert rc == code
    assert message in err and "Traceback" not in err


def test_unknown_profile_key_names_the_key_and_the_file(tmp_path, capsys):
    profile = tmp_path / "mine.toml"
    profile.write_text("[engine]\nblock_sise = 16\n")
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert main(["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--profile", str(profile)]) == 2
    err = capsys.readouterr().err
    assert "engine.block_sise" in err and "mine.toml" in err


def test_unreadable_input_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "Input file" in capsys.readouterr().err


def test_traceback_only_with_debug(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagecli", "--debug", "generate", str(tmp_path / "x"),
                           "-o", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" in proc.stderr
