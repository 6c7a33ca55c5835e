"""`bench memory --json`, `bench run --json/--plot` write only where nothing is, or where a pagecli report of
the same kind is; any other file is refused before the workload runs and left as it was, unless --force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pagecli.cli.bench  # noqa: F401 - registers `pagecli bench`
from pagecli.bench.report_files import check_report_path
from pagecli.cli.app import app
from pagecli.errors import PagecliError

MEMORY = ["bench", "memory", "--lengths", "800,2300", "--kv-bytes-per-token", "512"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_bench_memory_json_refuses_a_file_that_is_not_a_pagecli_report(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "data"}\n')
    with pytest.raises(PagecliError, match="not a pagecli json report, and pagecli does not overwrite it"):
        invoke(*MEMORY, "--json", str(mine))
    assert mine.read_text() == '{"my": "data"}\n'


def test_force_replaces_it(tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text("my notes\n")
    assert invoke(*MEMORY, "--json", str(mine), "--force").exit_code == 0
    assert json.loads(mine.read_text())["schema"] == "pagecli.bench.memory/1"


def test_a_pagecli_report_is_written_over_without_force(tmp_path):
    report = tmp_path / "memory.json"
    assert invoke(*MEMORY, "--json", str(report)).exit_code == 0
    assert invoke(*MEMORY, "--json", str(report)).exit_code == 0
    assert json.loads(report.read_text())["schema"] == "pagecli.bench.memory/1"


@pytest.mark.parametrize("flag, name", [("--json", "run.json"), ("--plot", "pool.png")])
def test_bench_run_refuses_before_the_model_loads(tmp_path, flag, name):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    mine = tmp_path / name
    mine.write_bytes(b"a user's file")
    with pytest.raises(PagecliError, match=f"choose another {flag} path, or pass --force"):
        invoke("bench", "run", "-m", str(tmp_path / "no-such-model"), flag, str(mine))
    assert mine.read_bytes() == b"a user's file"


def test_a_plot_pagecli_drew_is_pagecli_s_and_another_png_is_not(tmp_path):
    pytest.importorskip("matplotlib")
    from pagecli.bench.plot import plot_occupancy

    ours = tmp_path / "pool.png"
    plot_occupancy(str(ours), [0.0, 1.0], [0, 2], [0, 1], [4, 1], "test")
    check_report_path(str(ours), "plot", force=False)
    theirs = tmp_path / "photo.png"
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(PagecliError, match="not a pagecli plot report"):
        check_report_path(str(theirs), "plot", force=False)


@pytest.mark.parametrize("path", ["-", "/dev/null"])
def test_stdout_and_devices_may_be_written(path):
    check_report_path(path, "json", force=False)


def test_an_empty_file_or_a_new_path_may_be_written(tmp_path):
    (tmp_path / "empty.json").write_bytes(b"")
    check_report_path(str(tmp_path / "empty.json"), "json", force=False)
    check_report_path(str(tmp_path / "new.json"), "json", force=False)
