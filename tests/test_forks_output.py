"""Parallel sampling (n > 1): every candidate's output is the output of a lone request.

Greedy candidates must all equal the n = 1 output (an exact test that copy-on-write never lets one
candidate write into blocks another reads); seeded candidate i must equal a lone request with
seed + i; a tiny pool that forces preemption must change nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import PagecliError
from pagecli.models.loader import load_model

# Prompts as token ids, so their lengths (and so the partial last block) are exact: 13 and 30
# tokens end inside a block of 4 or 16, 16 ends on a block boundary.
PROMPTS = [list(range(40, 53)), list(range(100, 116)), [7, 9, 11, 200, 201, 5] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 512,
                "disk_cache": False, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def sampled(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_k": 50, "max_tokens": 12, "ignore_eos": True, **overrides})


def by_candidate(completions, n: int) -> list[list[tuple[int, ...]]]:
    """Completions of engine.generate grouped per prompt, candidate 0 first."""
    assert [c.index for c in completions] == list(range(n)) * (len(completions) // n)
    return [[c.token_ids for c in completions[i : i + n]] for i in range(0, len(completions), n)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_candidates_all_equal_the_lone_request(tiny_llama, block_size, prefix_caching):
    engine = make_engine(tiny_llama, block_size=block_size, enable_prefix_caching=prefix_caching)
    lone = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    forked = by_candidate(engine.generate(PROMPTS, SamplingParams(**{**GREEDY.__dict__, "n": 5})), 5)
    assert forked == [[tokens] * 5 for tokens in lone]


def test_seeded_candidate_i_equals_the_lone_request_with_seed_plus_i(tiny_llama):
    engine = make_engine(tiny_llama)
    forked = by_candidate(engine.generate(PROMPTS, sampled(seed=1234, n=4)), 4)
    for prompt, candidates in zip(PROMPTS, forked):
        lone = [engine.generate([prompt], sampled(seed=1234 + i))[0].token_ids for i in range(4)]
        assert candidates == lone
    assert len({tokens for candidates in forked for tokens in candidates}) > len(PROMPTS), \
        "seeded candidates were meant to differ from each other"


def test_seeded_candidates_are_the_same_run_after_run(tiny_llama):
    first = make_engine(tiny_llama).generate(PROMPTS, sampled(seed=7, n=3))
    second = make_engine(tiny_llama, block_size=16).generate(PROMPTS, sampled(seed=7, n=3))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


@pytest.mark.parametrize("sampling", [GREEDY, sampled(seed=99)], ids=["greedy", "seeded"])
def test_preemption_under_a_tiny_pool_changes_no_candidate(tiny_llama, sampling):
    many = SamplingParams(**{**sampling.__dict__, "n": 3, "max_tokens": 20})
    roomy = make_engine(tiny_llama).generate(PROMPTS, many)
    tight = make_engine(tiny_llama, num_blocks=24)
    squeezed = tight.generate(PROMPTS, many)
    assert [c.token_ids for c in squeezed] == [c.token_ids for c in roomy]
    assert tight.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"


def test_a_chunked_prompt_forks_once_its_last_chunk_is_computed(tiny_llama):
    lone = make_engine(tiny_llama).generate(PROMPTS, GREEDY)
    chunked = make_engine(tiny_llama, max_num_batched_tokens=5)
    forked = chunked.generate(PROMPTS, SamplingParams(**{**GREEDY.__dict__, "n": 2}))
    assert by_candidate(forked, 2) == [[c.token_ids] * 2 for c in lone]
    assert chunked.stats().prompt_tokens_computed == sum(len(p) for p in PROMPTS)


def test_more_candidates_than_max_num_seqs_still_run(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    forked = engine.generate(PROMPTS[:2], SamplingParams(**{**GREEDY.__dict__, "n": 4}))
    assert len(forked) == 8 and all(c.completion_tokens == GREEDY.max_tokens for c in forked)


def test_events_name_their_candidate_and_each_candidate_finishes_once(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(PROMPTS[0], sampled(seed=3, n=3, max_tokens=5), "r")
    events = list(engine.stream())
    assert sorted(ev.index for ev in events if ev.finished) == [0, 1, 2]
    assert all(ev.request_id == "r" for ev in events)
    assert [sum(1 for ev in events if ev.index == i) for i in range(3)] == [5, 5, 5]


def test_a_lone_request_is_candidate_zero(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(PROMPTS[0], GREEDY)
    assert {ev.index for ev in engine.stream()} == {0}


def test_aborting_a_forked_request_ends_every_candidate(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request(PROMPTS[1], sampled(seed=1, n=4, max_tokens=50), "r")
    while not engine.step():
        pass  # until the prompt is computed and the request has forked
    assert len(engine.scheduler.running) == 4
    engine.abort("r")
    assert not engine.has_unfinished and engine.stats().blocks_active == 0


@pytest.mark.parametrize("n", [0, -1, 257])
def test_n_out_of_range_is_refused(n):
    with pytest.raises(PagecliError, match="n must be between 1 and 256"):
        SamplingParams(n=n)


def test_the_candidate_seed_is_seed_plus_index():
    assert [SamplingParams(seed=10, n=3).candidate_seed(i) for i in range(3)] == [10, 11, 12]
    assert SamplingParams(n=3).candidate_seed(2) is None
    with pytest.raises(PagecliError, match="seed \\+ n - 1 must fit in 64 bits"):
        SamplingParams(seed=(1 << 64) - 1, n=2)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton needs a GPU or TRITON_INTERPRET=1 (conftest sets it on CPU)")
def test_triton_backend_candidates_equal_the_lone_request(tiny_llama):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(config=EngineConfig(dtype="float32", device=device, attention="triton", block_size=4,
                                        num_blocks=128, disk_cache=False),
                    loaded=load_model(tiny_llama, "float32", device, max_positions=512))
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    lone = engine.generate(PROMPTS[:1], short)[0].token_ids
    forked = engine.generate(PROMPTS[:1], SamplingParams(**{**short.__dict__, "n": 3}))
    assert [c.token_ids for c in forked] == [lone] * 3
    assert engine.stats().cow_block_copies == 2  # 13 tokens: the partial last block was copied for two of three
