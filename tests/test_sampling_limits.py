"""Sampling values that could overflow a computation are refused with one sentence when the settings are
built: a per-line field becomes that line's error record, a flag exits 2; the other lines run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagecli.cli import main
from pagecli.config import SamplingParams
from pagecli.errors import PagecliError

BEAMS = ["-t", "0", "-n", "4", "--ignore-eos", "--num-blocks", "64", "--threads", "1"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_a_huge_length_penalty_is_that_lines_error_and_the_others_run(tiny_llama, tmp_path, capsys):
    """Reproducer: `length_penalty` 1e308 ended the run with `Unexpected OverflowError`."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "hello", "beam_width": 2, "length_penalty": 1e308}) + "\n"
                   + json.dumps({"prompt": "hello", "beam_width": 2, "length_penalty": 1.5}) + "\n")
    assert main(["generate", str(src), "-o", str(dst), "-m", str(tiny_llama), *BEAMS]) == 0
    err = capsys.readouterr().err
    assert "Unexpected" not in err
    bad, good = records(dst)
    assert bad["error"] == "line 1: length_penalty must be between -10 and 10 (got 1e+308)."
    assert len(good["choices"]) == 1


def test_the_length_penalty_flag_is_refused_before_the_model_loads(tiny_llama, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert main(["generate", str(src), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_llama), *BEAMS,
                 "--beam-width", "2", "--length-penalty", "-1e308"]) == 2
    err = capsys.readouterr().err
    assert "length_penalty must be between -10 and 10" in err and "Loading model" not in err


@pytest.mark.parametrize("value", [10.0, -10.0, 0.0, 2.5])
def test_length_penalties_in_range_are_accepted(value):
    assert SamplingParams(temperature=0, beam_width=2, length_penalty=value).length_penalty == value


@pytest.mark.parametrize("value", [10.5, -11.0, 1e308])
def test_length_penalties_out_of_range_are_refused(value):
    with pytest.raises(PagecliError, match="length_penalty must be between -10 and 10"):
        SamplingParams(temperature=0, beam_width=2, length_penalty=value)
