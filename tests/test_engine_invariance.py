"""Paging, prefix hits, chunked prefill, preemption and batching never change greedy output."""

from __future__ import annotations

import pytest

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks. " * 3,
    "Hello world! How are you today?",
    "Très bien, merci. 日本語のテキスト。",
    "def main():\n    print('hello')\n" * 2,
    "fox",
]


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 16, "num_blocks": 256, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def run(engine: Engine, prompts=PROMPTS, sampling=GREEDY) -> list[tuple[int, ...]]:
    outs = [o.token_ids for o in engine.generate(prompts, sampling)]
    engine.pool.check_invariants()
    assert engine.stats().blocks_active == 0, "a finished batch left active blocks"
    return outs


@pytest.fixture(scope="module")
def baseline(tiny_model_factory):
    """Each prompt alone, unconstrained: the reference every variant must equal."""
    engine = make_engine(tiny_model_factory("llama"))
    return [run(engine, [p])[0] for p in PROMPTS]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_size_does_not_change_greedy_output(block_size, tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), block_size=block_size, num_blocks=4096 // block_size)
    assert run(engine) == baseline


def test_preemption_under_a_tiny_pool_does_not_change_output(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), block_size=4, num_blocks=40)
    assert run(engine) == baseline
    assert engine.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"


def test_chunked_prefill_with_a_tiny_token_budget(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), max_num_batched_tokens=5)
    assert run(engine) == baseline


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_on_or_off(prefix_caching, tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), block_size=4, enable_prefix_caching=prefix_caching)
    assert run(engine) == baseline
    assert run(engine) == baseline  # second pass: full prefix hits when caching is on
    hits = engine.stats().prefix_hit_tokens
    assert (hits > 0) == prefix_caching


def test_thirty_two_together_equal_one_alone(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), max_num_seqs=32)
    prompts = (PROMPTS * 6)[:32]
    assert run(engine, prompts) == (baseline * 6)[:32]


def test_repeated_prompt_is_served_from_the_prefix_cache(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"), block_size=4)
    prompt = PROMPTS[1]
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert first.token_ids == second.token_ids
    assert first.cached_tokens == 0
    n = first.prompt_tokens
    assert second.cached_tokens == ((n - 1) // 4) * 4  # every full block but the one holding the last token


def test_same_seed_same_sample(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    sampling = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    a = engine.generate([PROMPTS[0]], sampling)[0].token_ids
    b = engine.generate([PROMPTS[0], PROMPTS[2]], sampling)[0].token_ids
    c = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True))[0]
    assert a == b
    assert a != c.token_ids


def test_stop_string_truncates_text_and_finishes(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    full = engine.generate([PROMPTS[0]], GREEDY)[0].text
    assert len(full) > 4
    stop = full[2:4]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_a_stop_string_anywhere_in_the_text_ends_it_at_its_first_occurrence(tiny_model_factory):
    # The search looks only where a stop can end in the newest text: stops spanning tokens, at the start,
    # in the middle and at the end of the output must all still be found at their first occurrence.
    engine = make_engine(tiny_model_factory("llama"))
    full = engine.generate([PROMPTS[1]], GREEDY)[0].text
    assert len(full) > 12
    for start, length in [(0, 3), (3, 7), (len(full) // 2, 5), (len(full) - 4, 4)]:
        stop = full[start : start + length]
        sampling = SamplingParams(temperature=0, max_tokens=24, stop=("never in this text", stop), ignore_eos=True)
        out = engine.generate([PROMPTS[1]], sampling)[0]
        assert (out.finish_reason, out.text) == ("stop", full[: full.index(stop)]), stop


def test_max_tokens_finishes_with_length(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert (out.finish_reason, out.completion_tokens) == ("length", 3)


def test_prompt_longer_than_the_context_is_rejected_at_submission(tiny_model_factory):
    from pagecli.errors import PagecliError

    engine = make_engine(tiny_model_factory("llama"), max_model_len=32)
    with pytest.raises(PagecliError, match="holds at most 32"):
        engine.add_request("fox " * 100, GREEDY)
    assert not engine.has_unfinished


def test_requests_sent_together_wait_for_a_shared_prefix_being_prefilled(tiny_model_factory):
    # One batch of prompts that share a 40-token system prompt: the first computes it; the others
    # wait a step for its blocks instead of computing them again, and give the same tokens.
    shared = list(range(3, 43))
    prompts = [shared + [50 + i, 60 + i, 70 + i] for i in range(6)]
    folder = tiny_model_factory("llama")
    alone = [run(make_engine(folder, block_size=4), [p])[0] for p in prompts]
    engine = make_engine(folder, block_size=4)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert [o.cached_tokens for o in outs] == [0] + [40] * 5
    assert engine.stats().prompt_tokens_computed == 43 + 5 * 3
