"""`pagecli generate` with beam search: `choices` records (best first, with scores), --beam-width, resume."""

from __future__ import annotations

import json

import pytest

from pagecli.cli import main
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from test_cli_generate import generate, records

PROMPT = "The quick brown fox"


def engine_beams(model, prompt: str, **fields) -> list:
    """The engine's own completions for the prompt, as the generate command's defaults would run it."""
    engine = Engine(str(model), EngineConfig(disk_cache=False))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **fields)
    return engine.generate([prompt], params)


def test_a_beam_line_gets_its_n_best_beams_best_first_with_scores(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "beams", "prompt": PROMPT, "beam_width": 4, "n": 3, "length_penalty": 0.5,
                    "early_stopping": "never"}),
        json.dumps({"custom_id": "batch", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": PROMPT, "beam_width": 2, "early_stopping": True}}),
        json.dumps({"id": "plain", "prompt": PROMPT}),
    ]) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    beams, batch, plain = records(tmp_path / "out.jsonl")
    assert "text" in plain and "choices" not in plain
    assert [c["index"] for c in beams["choices"]] == [0, 1, 2] and [c["index"] for c in batch["choices"]] == [0]
    for choice in beams["choices"] + batch["choices"]:
        assert set(choice) == {"index", "text", "finish_reason", "completion_tokens", "score"}
    scores = [c["score"] for c in beams["choices"]]
    assert scores == sorted(scores, reverse=True)
    expected = engine_beams(tiny_llama, PROMPT, beam_width=4, n=3, length_penalty=0.5, early_stopping="never")
    assert [(c["text"], c["score"]) for c in beams["choices"]] == [(c.text, c.score) for c in expected]
    assert beams["completion_tokens"] == sum(c["completion_tokens"] for c in beams["choices"])


def test_the_beam_width_flag_applies_to_every_line(tiny_llama, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(f"{PROMPT}\nHello world!\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl", "--beam-width", "3", "--length-penalty", "2") == 0
    out = records(tmp_path / "out.jsonl")
    assert [len(r["choices"]) for r in out] == [1, 1]
    [best] = engine_beams(tiny_llama, PROMPT, beam_width=3, length_penalty=2.0)
    # The file's two lines run as one batch, the engine's beams alone: float32 products on some CPUs (AVX2,
    # PyTorch's own GEMM) round a row differently in a batch of 6 than of 3, so the score agrees to rounding.
    assert out[0]["choices"][0]["text"] == best.text
    assert out[0]["choices"][0]["score"] == pytest.approx(best.score, rel=1e-5)


def test_resume_keeps_whole_beam_records_and_reruns_the_cut_one(tiny_llama, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\n")
    dst = tmp_path / "out.jsonl"
    assert generate(tiny_llama, src, dst, "--beam-width", "3", "--n", "2") == 0
    complete = dst.read_text().splitlines(keepends=True)
    dst.write_text(complete[0] + complete[1][:60])  # killed while writing line 2's record
    assert generate(tiny_llama, src, dst, "--beam-width", "3", "--n", "2") == 0
    assert dst.read_text() == "".join(complete)


def test_bad_beam_fields_are_the_lines_error(tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "fox", "beam_width": 2, "temperature": 0.8},
        {"prompt": "fox", "beam_width": 2, "n": 3},
        {"prompt": "fox", "beam_width": 2, "early_stopping": "sometimes"},
        {"prompt": "fox", "beam_width": "2"},
        {"prompt": "fox", "beam_width": 2},
    ]) + "\n")
    assert generate(tiny_llama, src, tmp_path / "out.jsonl") == 0
    *bad, good = records(tmp_path / "out.jsonl")
    assert [r["error"].split(": ", 1)[0] for r in bad] == ["line 1", "line 2", "line 3", "line 4"]
    assert "set temperature 0" in bad[0]["error"] and "n 3 is more than beam_width 2" in bad[1]["error"]
    assert "early_stopping must be" in bad[2]["error"] and "'beam_width' must be an integer" in bad[3]["error"]
    assert len(good["choices"]) == 1


def test_commands_without_beam_search_refuse_the_flag(tiny_llama, capsys):
    assert main(["serve", "-m", str(tiny_llama), "--beam-width", "2", "-t", "0"]) != 0
    assert "does not run beam search" in capsys.readouterr().err
