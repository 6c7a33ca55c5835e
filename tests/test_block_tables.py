"""The block tables kept between steps (engine/block_tables.py) equal the ones rebuilt from the sequences'
lists after every kind of step: new sequences, finished ones, preemption and resumption, chunked prefill,
forks with copy-on-write, beams reordered, prefix hits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.block_tables import KeptBlockTables
from pagecli.models.loader import load_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks. " * 3,
    "The quick brown fox jumps over the lazy cat, twice.",
    "def main():\n    print('hello')\n" * 2,
    "fox",
]


def rebuilt(seqs) -> torch.Tensor:
    """The step's tables the old way: padded lists, one tensor."""
    width = max(len(seq.block_table) for seq in seqs) or 1
    return torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs], dtype=torch.int32)


class CheckedTables(KeptBlockTables):
    """Kept tables that compare themselves with rebuilt ones at every step."""

    steps = 0

    def gather(self, seqs):
        kept = super().gather(seqs)
        assert torch.equal(kept, rebuilt(seqs)), "kept block tables differ from the sequences' own"
        CheckedTables.steps += 1
        return kept


def run_checked(folder, sampling: SamplingParams, staggered: bool = False, **config) -> list:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 256,
                **config}
    engine = Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))
    engine.runner.block_tables = CheckedTables(torch.device("cpu"), rows=2, width=2)  # grown during the run
    CheckedTables.steps = 0
    if not staggered:
        return engine.generate(PROMPTS, sampling)
    # New requests join while others run and finish: rows are taken, given back and reused.
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, sampling)
        for _ in range(3 + i):
            if engine.has_unfinished:
                engine.step()
    while engine.has_unfinished:
        engine.step()
    return []


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("case, sampling, config", [
    ("prefix hits", GREEDY, {"enable_prefix_caching": True}),
    ("preemption", GREEDY, {"num_blocks": 30}),
    ("chunked prefill", GREEDY, {"max_num_batched_tokens": 5}),
    ("forks with copy-on-write", SamplingParams(temperature=0.8, n=3, max_tokens=12, seed=1, ignore_eos=True), {}),
    ("beams", SamplingParams(temperature=0, beam_width=3, n=2, max_tokens=10), {}),
])
def test_kept_tables_equal_rebuilt_ones_after_every_step(tiny_model_factory, case, sampling, config):
    run_checked(tiny_model_factory("llama"), sampling, **config)
    assert CheckedTables.steps > 10, case


def test_kept_tables_follow_sequences_that_join_and_finish(tiny_model_factory):
    sampling = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    run_checked(tiny_model_factory("llama"), sampling, staggered=True, max_num_seqs=3)
    assert CheckedTables.steps > 10


def test_a_decode_step_writes_only_the_new_block():
    tables = KeptBlockTables(torch.device("cpu"))
    seqs = [SimpleNamespace(block_table=[i, 10 + i]) for i in range(4)]
    tables.gather(seqs)
    written = tables.rows_written
    seqs[2].block_table.append(99)
    assert torch.equal(tables.gather(seqs), rebuilt(seqs))
    assert tables.rows_written == written + 1


def test_a_changed_block_a_shorter_table_and_a_reused_row_are_rewritten():
    tables = KeptBlockTables(torch.device("cpu"), rows=2, width=2)
    a, b, c = (SimpleNamespace(block_table=t) for t in ([1, 2, 3], [4, 5], [6]))
    assert torch.equal(tables.gather([a, b]), rebuilt([a, b]))
    a.block_table[1] = 7  # copy-on-write replaced a shared block
    b.block_table = [8]  # preempted and resumed with fewer blocks
    assert torch.equal(tables.gather([b, a]), rebuilt([b, a]))
    assert torch.equal(tables.gather([c]), rebuilt([c]))  # a and b's rows given back; c takes one
    assert torch.equal(tables.gather([c, a, b]), rebuilt([c, a, b]))


def test_tables_grown_inside_a_step_can_be_written_outside_one():
    # Steps run under torch.inference_mode; a table grown there must stay writable by a caller outside it.
    tables = KeptBlockTables(torch.device("cpu"), rows=1, width=1)
    seqs = [SimpleNamespace(block_table=[1, 2, 3]), SimpleNamespace(block_table=[4])]
    with torch.inference_mode():
        tables.gather(seqs)
    seqs[1].block_table.append(5)
    assert torch.equal(tables.gather(seqs), rebuilt(seqs))
