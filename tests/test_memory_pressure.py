"""Memory pressure: hundreds of requests through a pool that holds only a few sequences at once.

Everything finishes, preemption happens and is counted, greedy output equals an unconstrained run,
and nothing leaks (the conftest fixture checks the pool after each test as well). A request that
can never fit is refused when it is submitted, and the requests around it still run.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import PagecliError
from pagecli.models.loader import load_model

NUM_REQUESTS = 500
BLOCK_SIZE = 4
SMALL_POOL_BLOCKS = 16  # 64 tokens: a handful of the requests below at once


@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """Engines here run on one thread (a tiny model: more threads only contend); put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": BLOCK_SIZE,
                "disk_cache": False, "threads": 1, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def random_requests(count: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Token-id prompts of 1 to 24 tokens and 1 to 10 new tokens; half drawn from 4 ids so prefixes repeat."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        vocab = range(3, 7) if rng.random() < 0.5 else range(3, 380)
        prompt = [rng.choice(vocab) for _ in range(rng.randint(1, 24))]
        requests.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 10), ignore_eos=True)))
    return requests


def run_all(engine: Engine, requests) -> list[tuple[int, ...]]:
    ids = [engine.add_request(prompt, sampling) for prompt, sampling in requests]
    outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
    reasons: dict[str, str] = {}
    for event in engine.stream():
        outputs[event.request_id].extend(event.token_ids)
        if event.finished:
            reasons[event.request_id] = event.finish_reason
    assert set(reasons) == set(ids), "every request finishes"
    return [tuple(outputs[request_id]) for request_id in ids]


@pytest.fixture(scope="module")
def unconstrained(tiny_model_factory):
    """The same requests in a pool with room to spare (no preemption): the reference."""
    engine = make_engine(tiny_model_factory("llama"), num_blocks=4096, max_num_seqs=64)
    outputs = run_all(engine, random_requests(NUM_REQUESTS))
    assert engine.stats().num_preemptions == 0
    return outputs


def test_many_requests_through_a_tiny_pool_all_finish_with_unconstrained_output(tiny_model_factory, unconstrained):
    requests = random_requests(NUM_REQUESTS)
    engine = make_engine(tiny_model_factory("llama"), num_blocks=SMALL_POOL_BLOCKS, max_num_seqs=64)
    outputs = run_all(engine, requests)
    assert outputs == unconstrained
    assert [len(out) for out in outputs] == [sampling.max_tokens for _, sampling in requests]
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert (stats.blocks_active, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert stats.blocks_free + stats.blocks_cached == SMALL_POOL_BLOCKS


def test_pressure_with_a_small_step_budget_and_no_prefix_cache(tiny_model_factory, unconstrained):
    engine = make_engine(tiny_model_factory("llama"), num_blocks=SMALL_POOL_BLOCKS, max_num_seqs=8,
                         max_num_batched_tokens=7, enable_prefix_caching=False)
    assert run_all(engine, random_requests(NUM_REQUESTS)[:120]) == unconstrained[:120]
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("config, too_long, limit", [
    ({"num_blocks": SMALL_POOL_BLOCKS}, SMALL_POOL_BLOCKS * BLOCK_SIZE + 5, SMALL_POOL_BLOCKS * BLOCK_SIZE),
    ({"num_blocks": SMALL_POOL_BLOCKS}, SMALL_POOL_BLOCKS * BLOCK_SIZE, SMALL_POOL_BLOCKS * BLOCK_SIZE),
    ({"num_blocks": 64, "max_model_len": 32}, 40, 32),
])
def test_a_request_that_can_never_fit_is_refused_at_submission_and_the_others_run(
        config, too_long, limit, tiny_model_factory, unconstrained):
    engine = make_engine(tiny_model_factory("llama"), **config)
    assert engine.max_model_len == limit  # the pool (or max_model_len) caps the sequence length
    requests = random_requests(NUM_REQUESTS)[:40]
    kept = []
    for i, (prompt, sampling) in enumerate(requests):
        if i % 10 == 5:
            with pytest.raises(PagecliError, match=rf"has {too_long} tokens; this engine holds at most {limit}"):
                engine.add_request([7] * too_long, sampling)
        kept.append(engine.add_request(prompt, sampling))
    assert len(engine.scheduler.waiting) == len(kept), "a refused request leaves nothing queued"
    outputs: dict[str, tuple[int, ...]] = {k: () for k in kept}
    for event in engine.stream():
        outputs[event.request_id] += event.token_ids
    for k, (prompt, _), reference in zip(kept, requests, unconstrained):
        assert outputs[k] == reference[: limit - len(prompt)]  # cut at max_model_len, else the same
