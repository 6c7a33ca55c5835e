"""`bench memory --forks`: KV blocks with block sharing against per-candidate copies, measured on a model."""

from __future__ import annotations

from pagecli.bench.sharing import measure_sharing
from pagecli.cli import main
from test_beam_parity import engine_for


def test_parallel_sampling_holds_the_prompt_once_exactly(tiny_llama):
    # 16 prompt tokens = 4 full blocks of 4. After the prefill step the 4 candidates share those 4 blocks
    # (copies: 16); the next step each writes its second token into a block of its own and finishes.
    engine = engine_for(tiny_llama)
    figures = measure_sharing(engine, [list(range(40, 56))], "parallel sampling", 4, 2)
    assert (figures.block_steps_shared, figures.block_steps_copies) == (4, 16)
    assert (figures.peak_blocks_shared, figures.peak_blocks_copies) == (4, 16)
    assert figures.saved_share == 0.75


def test_beam_search_shares_history_and_saves_more_than_nothing(tiny_llama):
    engine = engine_for(tiny_llama)
    figures = measure_sharing(engine, [list(range(40, 53)), list(range(60, 90))], "beam search", 3, 12)
    assert 0 < figures.block_steps_shared < figures.block_steps_copies
    assert figures.peak_blocks_shared < figures.peak_blocks_copies
    assert engine.pool.counts().active == 0


def test_bench_memory_forks_prints_both_scenarios(tiny_llama, capsys):
    assert main(["bench", "memory", "--lengths", "20,30", "--forks", "2", "--fork-tokens", "4", "-b", "4",
                 "-m", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert "Block sharing, measured" in out and "parallel" in out and "beam" in out and "%" in out


def test_bench_memory_refuses_a_fork_width_below_two(tiny_llama, capsys):
    assert main(["bench", "memory", "--lengths", "20", "--forks", "1", "-m", str(tiny_llama)]) != 0
    assert "--forks must be from 2 to 256" in capsys.readouterr().err


def test_bench_memory_json_carries_the_fork_figures(tiny_llama, tmp_path, capsys):
    import json

    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--lengths", "20", "--forks", "2", "--fork-tokens", "3", "-b", "4",
                 "-m", str(tiny_llama), "--json", str(out)]) == 0
    from test_bench import assert_matches_doc

    document = json.loads(out.read_text())
    assert_matches_doc(document, "pagecli.bench.memory/1")  # every field written is documented, and back
    forks = document["forks"]
    assert [f["scenario"] for f in forks] == ["parallel sampling", "beam search"]
    for f in forks:
        assert f["width"] == 2 and f["output_tokens"] == 3
        assert f["saved_share"] == round(1 - f["block_steps_shared"] / f["block_steps_copies"], 6)
