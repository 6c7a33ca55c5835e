"""Commands that run no model start in a blink: help, listings and argument errors import neither torch,
transformers nor triton, nor load pagecli's compiled kernels (issue 48). Each command runs in a fresh
interpreter, which then names the heavy modules it holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton")
NATIVE_PREFIX = "pagecli_cpu_ops_"  # the compiled kernels' module names (pagecli.native)
# The libraries `--help`, `generate --help` and `models` need none of (about 0.3 s between them): typer
# coerces values through pydantic, the GGUF type names come without gguf and numpy, and help is plain text
# (typer's rich help imports markdown_it and pygments).
NOT_FOR_THE_FIRST_COMMANDS = ("pydantic", "numpy", "gguf", "click", "safetensors", "tokenizers", "jinja2",
                              "markdown_it", "pygments")
PROBE = """
import sys
from pagecli.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print("TOP-LEVEL-MODULES:" + ",".join(sorted({name.split(".")[0] for name in sys.modules})), file=sys.stderr)
sys.exit(code)
"""

HELP = [
    ["--help"], ["-h"], ["--version"],
    ["generate", "--help"], ["chat", "--help"], ["serve", "--help"], ["models", "--help"], ["profiles", "--help"],
    ["doctor", "--help"], ["bench", "--help"], ["bench", "memory", "--help"], ["bench", "run", "--help"],
    ["bench", "perplexity", "--help"], ["cache", "--help"], ["cache", "ls", "--help"], ["cache", "stats", "--help"],
    ["cache", "clear", "--help"], ["cache", "prune", "--help"],
]
LISTINGS = [["models"], ["profiles"], ["cache"], ["cache", "ls"], ["cache", "stats"], ["cache", "ls", "--json"],
            ["cache", "stats", "--json"], ["doctor", "--quick"], ["doctor", "--quick", "--json"]]
ARGUMENT_ERRORS = [
    ["generate", "{missing}", "-o", "{out}"],
    ["generate", "{input}", "-o", "{input}"],
    ["generate", "{input}", "-o", "{out}", "--format", "xml"],
    ["generate", "{input}", "-o", "{out}", "--temperature", "hot"],
    ["generate", "{input}", "-o", "{out}", "--temperature", "-1"],
    ["generate", "{input}", "-o", "{out}", "--max-tokens", "0"],
    ["generate", "{input}", "-o", "{out}", "--profile", "no-such-profile"],
    ["generate", "{input}", "--no-such-flag"],
    ["chat", "--no-such-flag"],
    ["chat", "--top-p", "2"],
    ["serve", "--port", "not-a-port"],
    ["no-such-command"],
]


def modules_after(args: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    """Runs `pagecli ARGS` in a fresh interpreter; the top-level modules it imported, and the process."""
    run = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    marker = [line for line in run.stderr.splitlines() if line.startswith("TOP-LEVEL-MODULES:")]
    assert marker, run.stderr
    return marker[-1].removeprefix("TOP-LEVEL-MODULES:").split(","), run


def heavy_modules_after(args: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    """Runs `pagecli ARGS` in a fresh interpreter; the heavy modules it imported, and the process."""
    modules, run = modules_after(args)
    return [name for name in modules if name in HEAVY or name.startswith(NATIVE_PREFIX)], run


def _ids(commands: list[list[str]]) -> list[str]:
    return [" ".join(args) for args in commands]


@pytest.mark.parametrize("args", HELP, ids=_ids(HELP))
def test_help_imports_no_torch(args):
    heavy, run = heavy_modules_after(args)
    assert heavy == [], f"pagecli {' '.join(args)} imported {heavy}"
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("args", LISTINGS, ids=_ids(LISTINGS))
def test_listings_import_no_torch(args):
    heavy, run = heavy_modules_after(args)
    assert heavy == [], f"pagecli {' '.join(args)} imported {heavy}"
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("args", ARGUMENT_ERRORS, ids=_ids(ARGUMENT_ERRORS))
def test_argument_errors_import_no_torch(args, tmp_path):
    request = tmp_path / "in.jsonl"
    request.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    paths = {"missing": str(tmp_path / "missing.jsonl"), "input": str(request), "out": str(tmp_path / "out.jsonl")}
    args = [arg.format(**paths) for arg in args]
    heavy, run = heavy_modules_after(args)
    assert run.returncode != 0, f"pagecli {' '.join(args)} should have failed: {run.stderr}"
    assert "Traceback" not in run.stderr and "Unexpected" not in run.stderr, run.stderr
    assert heavy == [], f"pagecli {' '.join(args)} imported {heavy}"
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["models"]], ids=" ".join)
def test_the_first_commands_people_type_import_only_what_they_use(args):
    modules, run = modules_after(args)
    assert run.returncode == 0, run.stderr
    assert [name for name in NOT_FOR_THE_FIRST_COMMANDS if name in modules] == []


def test_the_probe_sees_torch_when_a_command_needs_it():
    # The negative control: were the probe blind, every test above would pass.
    heavy, _ = heavy_modules_after(["doctor", "--json"])
    assert "torch" in heavy


def test_values_given_on_the_command_line_are_read_without_pydantic(tmp_path):
    # typer coerces every value through a pydantic TypeAdapter; cli/help_style.py reads plain str, int and float
    # values itself (the first-token time of `chat` against a running server is mostly start-up).
    missing, out = str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl")
    modules, run = modules_after(["generate", missing, "-o", out, "--temperature", "0.5", "--max-tokens", "16",
                                  "--top-p", "1e-1", "--seed", "-3", "--format", "jsonl", "--stop", "x"])
    assert run.returncode != 0 and "missing.jsonl" in run.stderr, run.stderr
    assert "pydantic" not in modules


@pytest.mark.parametrize("value", ["0", "-0", "007", "12345678901234567890", "0.5", "-0.25", "1e3", "1E-3", "1e400",
                                   "3.14159265358979323846", "2.5e-308", " 5", "1_000", "+5", "5.", "hot", "inf", 3, 2.5,
                                   True, "true", (), ("a", "b")])
def test_values_read_without_pydantic_equal_typers_own(value):
    """Where help_style reads a value itself, it gives what typer's adapter gives; elsewhere typer's adapter runs."""
    from typer._coercion import build_runtime_param, resolve_type_descriptor
    from typer.models import OptionInfo

    from pagecli.cli.help_style import _PlainValue

    for kind in (int, float, str, bool, list[str]):
        descriptor = resolve_type_descriptor(kind, OptionInfo())
        mine = _PlainValue(descriptor.parameter_info, kind, descriptor)
        typers = build_runtime_param(descriptor)
        try:
            expected = typers._coerce_value(value, param=None, ctx=None)
        except Exception as error:  # noqa: BLE001 - the same refusal either way
            with pytest.raises(type(error)):
                mine._coerce_value(value, param=None, ctx=None)
            continue
        got = mine._coerce_value(value, param=None, ctx=None)
        assert (got, type(got)) == (expected, type(expected)) or (got != got and expected != expected)
