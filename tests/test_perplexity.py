"""`pagecli bench perplexity`: llama-perplexity's windows, the same figure transformers gives on the same
weights, and the command over the shipped text (tests/data/declaration.txt: the US Declaration of
Independence, public domain, written out from memory, so it may differ in small details from the
engrossed copy)."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import pagecli.cli.bench  # noqa: F401 - registers `bench` on the app
from pagecli.bench.perplexity import perplexity, text_windows
from pagecli.cli import app, main
from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.errors import PagecliError

TEXT = Path(__file__).parent / "data" / "declaration.txt"


def test_windows_do_not_overlap_drop_the_tail_and_start_with_bos():
    ids = list(range(100, 125))
    assert text_windows(ids, 10, None) == [ids[0:10], ids[10:20]]
    assert text_windows(ids, 10, 1) == [[1, *ids[1:10]], [1, *ids[11:20]]]


@pytest.mark.parametrize(("count", "ctx", "fragment"), [(5, 10, "fewer than one window"), (50, 4, "at least 8")])
def test_a_text_shorter_than_a_window_or_a_tiny_ctx_is_refused(count, ctx, fragment):
    with pytest.raises(PagecliError, match=fragment):
        text_windows(list(range(count)), ctx, None)


def transformers_perplexity(folder: Path, windows: list[list[int]]) -> tuple[float, float]:
    """(perplexity, its standard error: ppl * stdev of the per-token losses / sqrt(count))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    per_token: list[float] = []
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window])
            logits = model(ids).logits[0].float()  # [ctx, vocab]
            first = len(window) // 2
            losses = -torch.log_softmax(logits[first:-1], dim=-1).gather(1, ids[0, first + 1:, None])
            per_token += losses.double().flatten().tolist()
    ppl = math.exp(statistics.fmean(per_token))
    return ppl, ppl * statistics.stdev(per_token) / math.sqrt(len(per_token))


def test_perplexity_equals_transformers_on_the_same_weights(tiny_model_factory):
    folder = tiny_model_factory("llama", max_position_embeddings=512)
    config = EngineConfig(dtype="float32", device="cpu", attention="torch", disk_cache=False, block_size=4)
    with Engine(str(folder), config) as engine:
        seen = []
        result = perplexity(engine, TEXT.read_text(encoding="utf-8"), 64, lambda *args: seen.append(args))
        ids = engine.tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = text_windows(ids, 64, None)
    assert result.windows == len(windows) >= 3 and result.tokens_scored == len(windows) * 31
    assert [s[:2] for s in seen] == [(i + 1, len(windows)) for i in range(len(windows))]
    assert result.running_ppl[-1] == result.ppl
    ppl, stderr = transformers_perplexity(folder, windows)
    assert result.ppl == pytest.approx(ppl, rel=1e-4)
    assert result.stderr == pytest.approx(stderr, rel=1e-3) and 0 < result.stderr < result.ppl


def test_the_command_prints_perplexity_over_the_shipped_text(tiny_model_factory):
    folder = tiny_model_factory("llama", max_position_embeddings=512)
    result = CliRunner().invoke(app, ["bench", "perplexity", str(TEXT), "-m", str(folder), "--ctx", "128",
                                      "--no-disk-cache", "--dtype", "float32"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    match = re.search(r"perplexity (\d+\.\d+) \+/- \d+\.\d+ .*quantize none \(auto\), kv float32, (\d+) windows of 128 tokens", result.output)
    assert match and float(match.group(1)) > 1 and int(match.group(2)) >= 1, result.output
    assert "[1/" in result.output  # progress, one line a window


def test_the_command_refuses_a_missing_file_in_one_line(tiny_model_factory, capsys):
    code = main(["bench", "perplexity", "/nonexistent.txt", "-m", str(tiny_model_factory("llama"))])
    err = capsys.readouterr().err
    assert code != 0 and "Cannot read '/nonexistent.txt'" in err and "Traceback" not in err
