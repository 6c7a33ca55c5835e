"""The bad input catalogue: each mistake ends in one clear sentence and an exit code, never a traceback.

Cases tested elsewhere are not repeated here: a nonexistent model path, a folder without config or
tokenizer (test_model_source.py); invalid JSON, an empty or non-string prompt, temperature -1, an
unknown profile key (test_cli_generate.py); unknown slash commands in both chat modes (test_chat.py).
"""

from __future__ import annotations

import io
import json
import shutil
import sys

import pytest
import torch
from tiny_models import with_template_prefix

import pagecli.cli.chat  # noqa: F401 - registers `chat` on the app
from pagecli.cli import main

GREEDY = ["-t", "0", "-n", "3", "--ignore-eos", "--num-blocks", "128", "--threads", "1"]



@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """Engines here run on one thread (a tiny model: more threads only contend); put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_clear_line(err: str, *fragments: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, err
    assert all(f in lines[0] for f in fragments), lines[0]
    assert "Traceback" not in err


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- model folders ----------------------------------------------------------------------------------------
def _without_weights(folder):
    (folder / "model.safetensors").unlink()


def _unsupported_architecture(folder):
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))


def _truncated_weights(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage_weights(folder):
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 20)


@pytest.mark.parametrize("damage, fragments", [
    (_without_weights, ["has no *.safetensors weights"]),
    (_unsupported_architecture, ["Architecture 'gpt2' is not supported", "Llama", "Qwen3"]),
    (_truncated_weights, ["Cannot read weights", "model.safetensors", "corrupt or truncated"]),
    (_garbage_weights, ["Cannot read weights", "model.safetensors", "corrupt or truncated"]),
], ids=["no weights", "unsupported architecture", "truncated safetensors", "garbage safetensors"])
def test_a_broken_model_folder_is_one_sentence_and_exit_code_3(damage, fragments, tiny_llama, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    damage(folder)
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    code, _, err = run(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "-m", str(folder), *GREEDY], capsys)
    assert code == 3
    assert_one_clear_line(err, *fragments)


# --- a tokenizer without a chat template ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_without_chat_template(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_messages_without_a_chat_template_fall_back_to_plain_text_and_say_so_once(
        model_without_chat_template, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hello {i}"}]}) + "\n"
                           for i in range(3)))
    dst = tmp_path / "out.jsonl"
    code, _, err = run(["generate", str(src), "-o", str(dst), "-m", str(model_without_chat_template), *GREEDY],
                       capsys)
    assert code == 0, err
    assert [r["completion_tokens"] for r in records(dst)] == [3, 3, 3]
    assert err.count("no chat template") == 1, err
    assert "plain text" in err


def test_chat_without_a_chat_template_says_so_once(model_without_chat_template, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhow are you\nbye\n"))
    code, out, err = run(["chat", str(model_without_chat_template), "--device", "cpu", "--dtype", "float32",
                          "--num-blocks", "96", "--threads", "1", "--temperature", "0", "--max-tokens", "3"], capsys)
    assert code == 0, err
    assert err.count("no chat template") == 1, err


# --- batch input lines ------------------------------------------------------------------------------------
def test_odd_lines_become_error_records_naming_the_line(tiny_llama, tmp_path, capsys):
    lines = [
        '{"prompt": "ok one"}',
        "[1, 2, 3]",
        "null",
        '{"messages": []}',
        '{"messages": [{"role": "user", "content": 5}]}',
        '{"messages": "hello"}',
        '{"prompt": "   "}',
        '{"prompt": "ok", "id": true}',
        '{"prompt": "ok", "stop": 5}',
        '{"prompt": "ok", "top_k": 1.5}',
        '{"prompt": "ok", "top_p": 2}',
        '{"prompt": "ok", "max_tokens": 0}',
        '{"prompt": "ok", "temperature": "hot"}',
        '{"body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "custom_id": "x"}',
        '{"prompt": "ok", "seed": 18446744073709551616, "temperature": 0.5}',
        '{"prompt": "ok two"}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    code, _, err = run(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY], capsys)
    assert code == 0, err
    out = records(dst)
    assert [r["line"] for r in out] == list(range(1, len(lines) + 1))
    errors = {r["line"]: r["error"] for r in out if "error" in r}
    assert set(errors) == set(range(2, len(lines)))
    assert all(e.startswith(f"line {n}: ") for n, e in errors.items())
    expected = {2: "expected a JSON object", 3: "expected a JSON object", 4: "non-empty list",
                5: "'content' must be a string", 6: "non-empty list", 7: "empty", 8: "'id' must be",
                9: "'stop' must be",
                10: "'top_k' must be an integer", 11: "top_p must be in (0, 1]", 12: "max_tokens must be at least 1",
                13: "'temperature' must be a number", 14: "max_tokens must be at least 1",
                15: "seed must fit in 64 bits"}
    for line, fragment in expected.items():
        assert fragment in errors[line], (line, errors[line])
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def model_with_a_strict_template(tiny_llama, tmp_path_factory):
    """The tiny model, its chat template refusing a system message after the first (raise_exception)."""
    return with_template_prefix(tiny_llama, tmp_path_factory.mktemp("strict-template") / "model")


ONE_BAD_LINE = {
    "the template raises": (json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "system", "content": "late"}]}),
                            "the chat template rejected this conversation: System message must come first"),
    "a lone surrogate in the prompt": ('{"prompt": "bad \\ud800 text"}', "line 3: the prompt could not be tokenized"),
    "a lone surrogate in the id": ('{"id": "\\udc80", "prompt": ""}', "line 3: 'prompt' is empty"),
    "JSON nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "line 3: invalid JSON (nested too deeply)"),
    "a 5,000-digit integer": ('{"prompt": "hi", "seed": ' + "7" * 5000 + "}",
                              "line 3: invalid JSON (Exceeds the limit (4300 digits)"),
    "a prompt longer than the context": (json.dumps({"prompt": "fox " * 600}), "tokens; this engine holds at most"),
}


@pytest.mark.parametrize("fault", list(ONE_BAD_LINE))
def test_one_line_that_fails_gets_its_error_record_and_the_other_three_are_answered(
        fault, model_with_a_strict_template, tmp_path, capsys):
    bad_line, message = ONE_BAD_LINE[fault]
    src = tmp_path / "in.jsonl"
    ok = [json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
          '{"prompt": "hello"}', '{"prompt": "world"}']
    src.write_text("\n".join([ok[0], ok[1], bad_line, ok[2]]) + "\n")
    dst = tmp_path / "out.jsonl"
    code, _, err = run(["generate", str(src), "-o", str(dst), "-m", str(model_with_a_strict_template), *GREEDY],
                       capsys)
    assert code == 0, err
    out = records(dst)
    assert [r["line"] for r in out] == [1, 2, 3, 4]
    assert [r["completion_tokens"] for r in out if "text" in r] == [3, 3, 3]
    assert set(out[2]) == {"id", "line", "error", "line_sha256", "settings_sha256"} and message in out[2]["error"], out[2]
    assert "Traceback" not in err and "Unexpected" not in err


def test_a_one_megabyte_prompt_is_refused_for_its_line_and_the_rest_runs(tiny_llama, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    huge = ("The quick brown fox jumps over the lazy dog. " * 23_000)[: 1 << 20]
    src.write_text(json.dumps({"prompt": "before"}) + "\n" + json.dumps({"prompt": huge}) + "\n"
                   + json.dumps({"prompt": "after"}) + "\n")
    dst = tmp_path / "out.jsonl"
    code, _, err = run(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY], capsys)
    assert code == 0, err
    before, refused, after = records(dst)
    assert refused["line"] == 2 and "tokens; this engine holds at most" in refused["error"]
    assert "Shorten it" in refused["error"]
    assert before["completion_tokens"] == after["completion_tokens"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "2"], "top_p must be in (0, 1] (got 2.0)."),
    (["--max-tokens", "0"], "max_tokens must be at least 1 (got 0)."),
    (["--top-k", "-1"], "top_k must be 0 (off) or more"),
    (["--repetition-penalty", "0"], "repetition_penalty must be positive"),
    (["--num-blocks", "0"], "num_blocks must be at least 1."),
])
def test_absurd_values_as_flags_are_one_sentence_and_exit_code_2(flags, message, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    code, _, err = run(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), *flags], capsys)
    assert code == 2
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--temperature", "abc"], "Invalid value for '--temperature'"),
    (["--bogus"], "No such option: --bogus"),
    (["--format", "xml"], "--format must be auto, jsonl or text"),
])
def test_usage_mistakes_are_exit_code_2_not_an_unexpected_error(args, message, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    code, _, err = run(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), *args], capsys)
    assert code == 2, err
    assert message in err and "Unexpected" not in err and "Traceback" not in err


def test_a_missing_argument_is_exit_code_2(capsys):
    code, _, err = run(["generate"], capsys)
    assert code == 2 and "Missing argument" in err and "Unexpected" not in err


# --- profiles -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, fragments", [
    ('[engine]\nblock_size = "16"\n', ["Key 'engine.block_size'", "must be an integer", "(got '16')"]),
    ('[sampling]\ntemperature = "hot"\n', ["Key 'sampling.temperature'", "must be a number"]),
    ("[sampling]\nstop = 5\n", ["Key 'sampling.stop'", "list of strings"]),
    ("[sampling]\nignore_eos = 1\n", ["Key 'sampling.ignore_eos'", "true or false"]),
    ("engine = 3\n", ["'[engine]'", "must be a table"]),
    ("model = 5\n", ["Key 'model'", "must be a string"]),
    ("colour = 'blue'\n", ["Unknown key 'colour'", "allowed top-level keys"]),
    ("[sampling]\ntop_p = 2.0\n", ["top_p must be in (0, 1]"]),
    ("[engine\nblock_size = 16\n", ["is not valid TOML"]),
])
def test_a_bad_profile_names_the_key_and_the_file(text, fragments, tmp_path, capsys):
    profile = tmp_path / "mine.toml"
    profile.write_text(text)
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    code, _, err = run(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "--profile", str(profile)], capsys)
    assert code == 2
    assert_one_clear_line(err, "mine.toml", *fragments)


def test_a_profile_that_is_not_utf8_is_one_sentence(tmp_path, capsys):
    profile = tmp_path / "latin1.toml"
    profile.write_bytes(b'description = "caf\xe9"\n')
    code, _, err = run(["generate", "-", "-o", "-", "--profile", str(profile)], capsys)
    assert code == 2
    assert_one_clear_line(err, "Cannot read profile", "latin1.toml")


# --- bytes that are not UTF-8 ------------------------------------------------------------------------------
def test_generate_input_with_bytes_that_are_not_utf8_still_runs_every_line(tiny_llama, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_bytes(b"caf\xe9 au lait\n\xff\xfe binary noise \x80\n" + "naïve, in UTF-8\n".encode())
    dst = tmp_path / "out.jsonl"
    code, _, err = run(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *GREEDY], capsys)
    assert code == 0, err
    assert [(r["line"], r["completion_tokens"]) for r in records(dst)] == [(1, 3), (2, 3), (3, 3)]


def test_chat_stdin_with_bytes_that_are_not_utf8_gets_replies(tiny_llama, capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n\xff\xfe\n/help\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = run(["chat", str(tiny_llama), "--jsonl", "--device", "cpu", "--dtype", "float32",
                          "--num-blocks", "96", "--threads", "1", "--temperature", "0", "--max-tokens", "3"], capsys)
    assert code == 0, err
    turns = [json.loads(line) for line in out.splitlines()]
    assert [t["user"] for t in turns] == ["caf\N{REPLACEMENT CHARACTER} au lait", "\N{REPLACEMENT CHARACTER}" * 2]
    assert "Traceback" not in err
