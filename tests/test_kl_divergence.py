"""`pagecli bench perplexity --kl-base`: a base run's top next tokens saved, a later run's KL divergence
from them (pagecli/bench/kl_divergence.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import pagecli.cli.bench  # noqa: F401 - registers `bench` on the app
from pagecli.bench import kl_divergence as kl
from pagecli.cli import app, main
from pagecli.errors import PagecliError

TEXT = Path(__file__).parent / "data" / "declaration.txt"


def full_kl(base: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """KL(base || run) per row over the whole vocabulary; both [n, vocab] log-probabilities."""
    return (base.double().exp() * (base.double() - run.double())).sum(dim=1)


def compare(base_logp: torch.Tensor, run_logp: torch.Tensor) -> kl.Divergence:
    recorder = kl.Recorder()
    targets = torch.zeros(len(base_logp), dtype=torch.int64)
    recorder(base_logp, targets)
    comparer = kl.Comparer(recorder.base(64, "digest", "base", 10.0))
    comparer(run_logp, targets)
    return comparer.result()


def test_over_a_vocabulary_within_the_top_k_the_divergence_is_the_full_one():
    """Up to the float32 rounding of the stored log-probabilities."""
    gen = torch.Generator().manual_seed(0)
    base = torch.log_softmax(torch.randn(40, 100, generator=gen), dim=-1)
    run = torch.log_softmax(base + 0.3 * torch.randn(40, 100, generator=gen), dim=-1)
    result = compare(base, run)
    assert result.mean == pytest.approx(float(full_kl(base, run).mean()), rel=1e-3)
    assert result.same_top == pytest.approx(float((base.argmax(1) == run.argmax(1)).double().mean()))
    assert compare(base, base).mean == 0 and compare(base, base).same_top == 1


def test_past_the_top_k_the_tail_is_one_bucket_and_the_figure_a_lower_bound():
    gen = torch.Generator().manual_seed(1)
    base = torch.log_softmax(2 * torch.randn(30, 2000, generator=gen), dim=-1)
    run = torch.log_softmax(base + 0.5 * torch.randn(30, 2000, generator=gen), dim=-1)
    got, full = compare(base, run).mean, float(full_kl(base, run).mean())
    assert 0.5 * full < got <= full + 1e-12


def test_a_base_from_a_larger_vocabulary_is_refused():
    recorder = kl.Recorder()
    recorder(torch.log_softmax(torch.arange(500.0).repeat(3, 1), dim=-1), torch.zeros(3, dtype=torch.int64))
    comparer = kl.Comparer(recorder.base(64, "digest", "base", 10.0))
    with pytest.raises(PagecliError, match="past this model's vocabulary"):
        comparer(torch.log_softmax(torch.zeros(3, 100), dim=-1), torch.zeros(3, dtype=torch.int64))


def test_the_perplexity_change_comes_with_the_standard_error_of_the_paired_losses():
    gen = torch.Generator().manual_seed(2)
    base = torch.log_softmax(torch.randn(50, 30, generator=gen), dim=-1)
    run = torch.log_softmax(base + 0.2 * torch.randn(50, 30, generator=gen), dim=-1)
    targets = torch.randint(0, 30, (50,), generator=gen)
    recorder = kl.Recorder()
    recorder(base[:20], targets[:20])
    recorder(base[20:], targets[20:])  # two windows
    comparer = kl.Comparer(recorder.base(64, "digest", "base", 10.0))
    comparer(run[:20], targets[:20])
    comparer(run[20:], targets[20:])
    result = comparer.result()
    delta = (base.double() - run.double()).gather(1, targets[:, None]).squeeze(1)  # run's loss - base's
    ratio = float(delta.mean().exp())
    assert result.ppl_change == pytest.approx(ratio - 1, rel=1e-9)
    assert result.ppl_change_stderr == pytest.approx(ratio * float(delta.std()) / 50 ** 0.5, rel=1e-9)
    assert "+/- " in kl.describe(result, comparer.base, 10.0)

    old = recorder.base(64, "digest", "base", 10.0)
    old.nll = None  # a base file written before the losses were kept
    comparer = kl.Comparer(old)
    comparer(run, targets)
    assert comparer.result().ppl_change_stderr is None and "+/-" not in kl.describe(comparer.result(), old, 10.0)


def run_cli(args: list[str]):
    return CliRunner().invoke(app, ["bench", "perplexity", str(TEXT), "--ctx", "128", "--no-disk-cache", *args],
                              catch_exceptions=False)


def test_the_command_saves_a_base_then_compares_runs_with_it(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama", max_position_embeddings=512)
    base = tmp_path / "base.kl"
    saved = run_cli(["-m", str(folder), "--dtype", "float32", "--kl-base", str(base)])
    assert saved.exit_code == 0, saved.output
    assert base.exists() and "as the --kl-base" in saved.output
    same = run_cli(["-m", str(folder), "--dtype", "float32", "--kl-base", str(base)])
    assert same.exit_code == 0, same.output
    assert "mean 0, 99th percentile 0;" in same.output and "same top token at 100.0%" in same.output and "(+0.00% +/- 0.00%)" in same.output
    other = run_cli(["-m", str(folder), "--dtype", "bfloat16", "--kl-base", str(base)])
    match = re.search(r"mean ([\d.e+-]+), 99th percentile ([\d.e+-]+);", other.output)
    assert other.exit_code == 0 and match and float(match.group(1)) > 0, other.output


def test_a_base_of_another_ctx_or_file_is_refused_in_one_line(tiny_model_factory, tmp_path, capsys):
    folder = tiny_model_factory("llama", max_position_embeddings=512)
    base = tmp_path / "base.kl"
    assert run_cli(["-m", str(folder), "--dtype", "float32", "--kl-base", str(base)]).exit_code == 0
    code = main(["bench", "perplexity", str(TEXT), "-m", str(folder), "--ctx", "64", "--no-disk-cache",
                 "--kl-base", str(base)])
    err = capsys.readouterr().err
    assert code != 0 and "was written with --ctx 128" in err and "Traceback" not in err
    junk = tmp_path / "junk.kl"
    junk.write_text("not a base")
    code = main(["bench", "perplexity", str(TEXT), "-m", str(folder), "--ctx", "128", "--no-disk-cache",
                 "--kl-base", str(junk)])
    err = capsys.readouterr().err
    assert code != 0 and "Cannot read" in err and "--kl-base file" in err and "Traceback" not in err


def test_saving_a_base_never_writes_a_users_file_beside_it(tmp_path):
    """The base was written through PATH.partial, a name a user's file may have; now a temp file of pagecli's own."""
    import torch

    from pagecli.bench.kl_divergence import BaseDistributions

    mine = tmp_path / "base.pt.partial"
    mine.write_text("my notes\n")
    base = BaseDistributions(8, "d", "desc", 1.5, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    base.save(tmp_path / "base.pt")
    assert mine.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.pt", "base.pt.partial"]
    assert BaseDistributions.load(tmp_path / "base.pt").ppl == 1.5
