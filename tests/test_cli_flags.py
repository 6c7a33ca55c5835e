"""The shared engine and sampling flags: every command that runs the engine takes each one, and each
reaches EngineConfig or SamplingParams; and `--help` reads like a well-kept CLI."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import typer

from pagecli.cli import app, help_style, main
from pagecli.cli.options import ENGINE_FLAGS, RAY_FLAGS, SAMPLING_FLAGS
from pagecli.config.structured import StructuredSpec

SCHEMA_FILE = Path(__file__).parent / "data" / "person.schema.json"

# flag name -> (command-line words, the field's value they must produce)
FLAG_CASES = {
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "attention": (["--attention", "torch"], "torch"),
    "device": (["--device", "cpu"], "cpu"),
    "block_size": (["--block-size", "8"], 8),
    "kv_budget_gib": (["--kv-budget-gib", "0.125"], 0.125),
    "num_blocks": (["--num-blocks", "96"], 96),
    "max_num_seqs": (["--max-num-seqs", "3"], 3),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "77"], 77),
    "max_model_len": (["--max-model-len", "300"], 300),
    "no_prefix_caching": (["--no-prefix-caching"], False),
    "threads": (["--threads", "1"], 1),
    "disk_cache": (["--no-disk-cache"], False),
    "cache_prefix": (["--cache-prefix"], True),
    "quantize": (["--quantize", "int8"], "int8"),
    "kv_dtype": (["--kv-dtype", "int8"], "int8"),
    "speculate": (["--speculate", "ngram"], "ngram"),
    "num_speculative_tokens": (["--num-speculative-tokens", "6"], 6),
    "draft_model": (["--speculate", "draft", "--draft-model", "some/draft"], "some/draft"),  # one needs the other
    "draft_quantize": (["--draft-quantize", "int4"], "int4"),
    "lora": (["--lora", "sql=/adapters/sql", "--lora", "poet=/adapters/poet"],
             (("sql", "/adapters/sql"), ("poet", "/adapters/poet"))),
    "merge_lora": (["--merge-lora", "--lora", "sql=/adapters/sql"], True),  # merges exactly one adapter
    "max_loras": (["--max-loras", "3"], 3),
    "max_lora_rank": (["--max-lora-rank", "16"], 16),
    "max_tokens": (["--max-tokens", "5"], 5),
    "temperature": (["--temperature", "0.25"], 0.25),
    "top_p": (["--top-p", "0.5"], 0.5),
    "top_k": (["--top-k", "7"], 7),
    "min_p": (["--min-p", "0.1"], 0.1),
    "repetition_penalty": (["--repetition-penalty", "1.3"], 1.3),
    "presence_penalty": (["--presence-penalty", "0.5"], 0.5),
    "frequency_penalty": (["--frequency-penalty", "-0.25"], -0.25),
    "seed": (["--seed", "11"], 11),
    "stop": (["--stop", "END", "--stop", "STOP"], ("END", "STOP")),
    "ignore_eos": (["--ignore-eos"], True),
    "n": (["--n", "3"], 3),
    "beam_width": (["--beam-width", "3", "--temperature", "0"], 3),  # beam search is greedy: -t 0 with it
    "length_penalty": (["--length-penalty", "0.5"], 0.5),
    "json_schema": (["--json-schema", str(SCHEMA_FILE)],
                    StructuredSpec.json_schema(json.loads(SCHEMA_FILE.read_text(encoding="utf-8")))),
}
# Commands that show one completion per request take --n but refuse a value above 1 in one sentence.
REFUSED = {("n", "chat"), ("n", "bench run"), ("beam_width", "chat"), ("beam_width", "bench run")}


class Captured(BaseException):
    """Raised by the patched runner with the settings the command built, so nothing runs (a
    BaseException: the CLI turns every Exception into an error line)."""

    def __init__(self, settings):
        super().__init__("captured")
        self.settings = settings


def _capture(settings, *args, **kwargs):
    raise Captured(settings)


@pytest.fixture
def commands(monkeypatch, tmp_path):
    """Each engine-running command as argv, with its runner patched to capture the settings."""
    import pagecli.cli.bench as bench
    import pagecli.cli.chat as chat
    import pagecli.cli.generate as generate

    monkeypatch.setattr(generate, "run_generate", _capture)
    monkeypatch.setattr(chat, "run_chat", _capture)
    monkeypatch.setattr(bench, "run_bench", _capture)
    monkeypatch.setattr(bench, "load_workload", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "run_perplexity", _capture)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    return {
        "generate": ["generate", str(prompts), "-o", str(tmp_path / "out.jsonl")],
        "chat": ["chat"],
        "bench run": ["bench", "run", "mixed", "--count", "1"],
        "bench perplexity": ["bench", "perplexity", str(prompts)],
    }


def settings_of(argv: list[str]):
    try:
        main(argv)
    except Captured as captured:
        return captured.settings
    raise AssertionError(f"{argv} did not reach its runner")


def test_every_shared_flag_has_a_case_here():
    assert {flag.name for flag in (*ENGINE_FLAGS, *SAMPLING_FLAGS)} == set(FLAG_CASES)


@pytest.mark.parametrize("command", ["generate", "chat", "bench run", "bench perplexity"])
@pytest.mark.parametrize("flag", [*ENGINE_FLAGS, *SAMPLING_FLAGS], ids=lambda flag: flag.name)
def test_each_engine_command_carries_each_flag_into_the_settings(commands, command, flag):
    words, expected = FLAG_CASES[flag.name]
    if (flag.name, command) in REFUSED:
        assert main(commands[command] + words) != 0
        return
    settings = settings_of(commands[command] + words)
    target = settings.engine if flag in ENGINE_FLAGS else settings.sampling
    assert getattr(target, flag.field) == expected


@pytest.mark.parametrize("command", ["generate", "chat", "bench run", "bench perplexity"])
def test_an_unset_flag_leaves_the_profile_value(commands, command, tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text('[engine]\nblock_size = 32\nmax_num_seqs = 5\n[sampling]\nmax_tokens = 9\n')
    settings = settings_of(commands[command] + ["--profile", str(profile), "--max-num-seqs", "2"])
    assert (settings.engine.block_size, settings.engine.max_num_seqs, settings.sampling.max_tokens) == (32, 2, 9)


def test_bench_run_is_greedy_unless_temperature_is_given(commands):
    assert settings_of(commands["bench run"]).sampling.temperature == 0.0
    assert settings_of(commands["bench run"] + ["-t", "0.5"]).sampling.temperature == 0.5


def test_chat_takes_the_model_as_an_argument_or_an_option(commands):
    assert settings_of(["chat", "some/folder"]).model == "some/folder"
    assert settings_of(["chat", "-m", "other"]).model == "other"
    assert main(["chat", "a", "-m", "b"]) == 2


# --- generate's Ray flags (pagecli/cluster) ---------------------------------------------------------

# flag name -> (command-line words, the ClusterOptions field and the value they must produce)
RAY_FLAG_CASES = {
    "ray": (["--ray"], "address", None),
    "ray_address": (["--ray", "--ray-address", "10.1.2.3:6379"], "address", "10.1.2.3:6379"),
    "workers": (["--ray", "--workers", "3"], "workers", 3),
    "threads_per_worker": (["--ray", "--threads-per-worker", "2"], "threads_per_worker", 2),
}


def test_every_ray_flag_has_a_case_here():
    assert {flag.name for flag in RAY_FLAGS} == set(RAY_FLAG_CASES)


@pytest.mark.parametrize("flag", RAY_FLAGS, ids=lambda flag: flag.name)
def test_each_ray_flag_reaches_the_cluster_options(commands, monkeypatch, flag):
    pytest.importorskip("ray")
    import pagecli.cli.generate as generate

    seen = {}

    def capture(settings, *args, cluster=None, **kwargs):
        seen["cluster"] = cluster
        raise Captured(settings)

    monkeypatch.setattr(generate, "run_generate", capture)
    words, field, expected = RAY_FLAG_CASES[flag.name]
    settings_of(commands["generate"] + words)
    assert getattr(seen["cluster"], field) == expected
    settings_of(commands["generate"])
    assert seen["cluster"] is None, "without --ray the job runs in this process"


@pytest.mark.parametrize("words, message", [
    (["--workers", "2"], "--workers only applies with --ray"),
    (["--ray-address", "auto", "--threads-per-worker", "1"], "--ray-address, --threads-per-worker only applies"),
    (["--ray", "--workers", "0"], "--workers must be at least 1 (got 0)"),
])
def test_a_ray_flag_mistake_is_one_sentence(commands, capsys, words, message):
    assert main(commands["generate"] + words) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ray_without_ray_installed_says_how_to_install_it(commands, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` then raises ImportError
    assert main(commands["generate"] + ["--ray"]) != 0
    err = capsys.readouterr().err
    assert "pip install 'pagecli[ray]'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# --- help -------------------------------------------------------------------------------------------


def all_commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from all_commands(sub, (*path, name))


COMMAND_PATHS = [path for path, _ in all_commands(typer.main.get_command(app)) if path]


def rendered_help(path: tuple[str, ...], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "120")
    assert main([*path, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", [(), *COMMAND_PATHS], ids=lambda p: " ".join(p) or "pagecli")
def test_help_shows_no_type_tags_and_capital_arguments(path, capsys, monkeypatch):
    text = rendered_help(path, capsys, monkeypatch)
    for tag in ("<bool>", "<str>", "<int>", "<float>", "<path>", "{"):
        assert tag not in text, f"'{tag}' in the help of {' '.join(path)}"
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    arguments = [word.strip("[].") for word in usage.split("[OPTIONS]")[-1].split()]
    assert all(word == word.upper() for word in arguments), usage


def test_generate_help_names_its_argument_and_gives_flags_no_value(capsys, monkeypatch):
    text = rendered_help(("generate",), capsys, monkeypatch)
    assert "Usage: pagecli generate [OPTIONS] INPUT" in text
    assert re.search(r"--kv-budget-gib\s+GIB", text)
    assert re.search(r"--no-prefix-caching\s+Recompute", text), "a flag shows no value placeholder"
    assert re.search(r"--progress / --no-progress\s+Progress bar", text)


def test_help_groups_options_by_panel(capsys, monkeypatch):
    text = rendered_help(("generate",), capsys, monkeypatch)
    headings = [line.rstrip(":") for line in text.splitlines() if line and not line[0].isspace()][1:]
    assert headings == ["Arguments", "Options", "Engine", "Sampling", "Ray cluster"], headings
    engine = text.split("\nEngine:")[1].split("\nSampling:")[0]
    sampling = text.split("\nSampling:")[1].split("\nRay cluster:")[0]
    assert "--kv-budget-gib" in engine and "--temperature" not in engine
    assert "--temperature" in sampling and "--kv-budget-gib" not in sampling
    assert "╭" not in text and "\\[" not in text


def test_group_help_lists_each_commands_first_sentence_whole(capsys, monkeypatch):
    text = rendered_help((), capsys, monkeypatch)
    assert "Generate completions for every request in INPUT and write them to OUTPUT." in " ".join(text.split())
    assert "..." not in text.split("Commands:")[1]


def test_tidy_restyles_every_parameter():
    command = help_style.tidy(typer.main.get_command(app))
    for _, sub in all_commands(command):
        for param in sub.params:
            assert isinstance(param, (help_style.PlainArgument, help_style.PlainOption)), param
