"""A malformed model config.json or profile is one ModelError / PagecliError naming the file and the field
(issue 26, case 12), whichever command reads it."""

from __future__ import annotations

import json
import shutil

import pytest
from chat_helpers import run_cli

import pagecli.cli.bench  # noqa: F401 - registers `bench` on the app
import pagecli.cli.cache_cmd  # noqa: F401 - registers `cache` on the app
from pagecli.cli import main

CPU = ["--device", "cpu", "--dtype", "float32", "--num-blocks", "64", "--threads", "1", "--no-disk-cache",
       "-t", "0", "-n", "2"]


def _broken_copy(folder, tmp_path, change) -> tuple:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    data = json.loads((copy / "config.json").read_text())
    change(data)
    (copy / "config.json").write_text(json.dumps(data))
    return copy, str(copy / "config.json")


def _set(**values):
    def change(data: dict) -> None:
        for key, value in values.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
    return change


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Unexpected" not in lines[0] and "Traceback" not in err, err
    return lines[0]


BROKEN_CONFIGS = {  # id: (change to the tiny llama's config.json, fragments of the message besides the file)
    "no hidden_size": (_set(hidden_size=None), ["has no hidden_size"]),
    "no vocab_size": (_set(vocab_size=None), ["has no vocab_size"]),
    "zero layers": (_set(num_hidden_layers=0), ["num_hidden_layers = 0", "at least 1"]),
    "hidden_size a string": (_set(hidden_size="64"), ["hidden_size = '64'"]),
    "hidden_size a string, no head_dim": (_set(hidden_size="64", head_dim=None), ["hidden_size = '64'"]),
    "negative intermediate_size": (_set(intermediate_size=-128), ["intermediate_size = -128"]),
    "fractional heads": (_set(num_attention_heads=4.5), ["num_attention_heads = 4.5"]),
    "layers true": (_set(num_hidden_layers=True), ["num_hidden_layers = True"]),
    "heads do not divide hidden_size": (_set(num_attention_heads=5, head_dim=None),
                                        ["hidden_size 64 and num_attention_heads 5", "multiple"]),
    "kv heads do not divide heads": (_set(num_key_value_heads=3), ["num_key_value_heads 3", "multiple"]),
    "zero kv heads": (_set(num_key_value_heads=0), ["num_key_value_heads = 0"]),
    "zero vocab": (_set(vocab_size=0), ["vocab_size = 0"]),
    "eps a string": (_set(rms_norm_eps="x"), ["rms_norm_eps = 'x'"]),
    "negative context": (_set(max_position_embeddings=-1), ["max_position_embeddings = -1"]),
    "rope parameters a string": (_set(rope_parameters="x"), ["rope_parameters = 'x'"]),
}


@pytest.mark.parametrize("case", list(BROKEN_CONFIGS))
def test_a_malformed_config_json_names_the_file_and_the_field_when_chatting(case, tiny_llama, tmp_path, capsys,
                                                                            monkeypatch):
    change, fragments = BROKEN_CONFIGS[case]
    folder, config_path = _broken_copy(tiny_llama, tmp_path, change)
    code, _, err = run_cli(["chat", str(folder), *CPU], "hi\n", capsys, monkeypatch)
    line = _one_error_line(err)
    assert code == 3, err
    assert config_path in line and all(fragment in line for fragment in fragments), line


@pytest.mark.parametrize("case", ["no hidden_size", "zero layers", "heads do not divide hidden_size", "eps a string"])
def test_bench_memory_reads_the_same_checks(case, tiny_llama, tmp_path, capsys):
    change, fragments = BROKEN_CONFIGS[case]
    folder, config_path = _broken_copy(tiny_llama, tmp_path, change)
    code = main(["bench", "memory", "-m", str(folder), "-l", "100,200"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 3 and config_path in line and all(fragment in line for fragment in fragments), line


def test_a_config_transformers_refuses_names_the_file_and_the_field(tiny_model_factory, tmp_path, capsys,
                                                                    monkeypatch):
    # Scaled rope takes transformers' AutoConfig path, whose own type check raised a validation traceback class.
    folder, config_path = _broken_copy(tiny_model_factory("llama3"), tmp_path, _set(hidden_size="64"))
    code, _, err = run_cli(["chat", str(folder), *CPU], "hi\n", capsys, monkeypatch)
    line = _one_error_line(err)
    assert code == 3 and config_path in line and "hidden_size" in line, line


# --- profiles ----------------------------------------------------------------------------------------------------
BROKEN_PROFILES = {  # id: (profile text, fragments of the message besides the file)
    "string for an int": ('[engine]\nblock_size = "16"\n', ["engine.block_size", "must be an integer"]),
    "unknown key": ("[engine]\nblok_size = 16\n", ["Unknown key 'engine.blok_size'"]),
    "bad TOML": ("[engine\nblock_size = 16\n", ["is not valid TOML"]),
    "infinite budget": ("[engine]\nkv_budget_gib = inf\n", ["kv_budget_gib must be a finite number"]),
    "nan temperature": ("[sampling]\ntemperature = nan\n", ["temperature must be a finite number"]),
    "a table for a number": ("[engine.num_blocks]\nx = 1\n", ["engine.num_blocks", "must be an integer"]),
    "a number for a schema file": ("[sampling]\nstructured = 3\n", ["sampling.structured", "JSON schema file"]),
    "a schema file that is missing": ('[sampling]\nstructured = "none.json"\n', ["none.json", "does not exist"]),
}


@pytest.mark.parametrize("case", list(BROKEN_PROFILES))
def test_a_malformed_profile_names_the_file_and_the_field(case, tmp_path, capsys):
    text, fragments = BROKEN_PROFILES[case]
    profile = tmp_path / "mine.toml"
    profile.write_text(text)
    code = main(["cache", "ls", "--profile", str(profile)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and str(profile) in line and all(fragment in line for fragment in fragments), line


def test_a_profile_names_a_schema_file_beside_it(tmp_path):
    from pagecli.config.profiles import load_profile

    (tmp_path / "person.json").write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}}))
    profile = tmp_path / "mine.toml"
    profile.write_text('[sampling]\nstructured = "person.json"\n')
    spec = load_profile(str(profile)).sampling_params().structured
    assert spec.kind == "json_schema" and json.loads(spec.value)["properties"] == {"name": {"type": "string"}}


@pytest.mark.parametrize(("name", "fragment"), [
    ("{tmp}", "is a folder, not a TOML file"),
    ("p" * 300, "Unknown profile"),
    ("p" * 300 + ".toml", "does not exist"),
])
def test_a_profile_name_that_is_no_file_is_one_sentence(name, fragment, tmp_path, capsys):
    code = main(["cache", "ls", "--profile", name.format(tmp=tmp_path)])
    assert code == 2 and fragment in _one_error_line(capsys.readouterr().err)
