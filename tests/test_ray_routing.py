"""Prefix-aware routing (pagecli/cluster/routing.py): the same first blocks go to the same worker, different
ones spread, and load bounds the preference. Also how many workers a run starts. Pure functions: no Ray needed."""

from __future__ import annotations

import random

import pytest

from pagecli.cluster.routing import Router, route_key

BLOCK = 16
WORKERS = ("w0", "w1", "w2", "w3")


def prompt(head: int, tail: int, length: int = 100) -> list[int]:
    """Token ids whose first 64 depend on `head` only and the rest on `tail`."""
    rng_head, rng_tail = random.Random(head), random.Random(10_000 + tail)
    return [rng_head.randrange(400) for _ in range(64)] + [rng_tail.randrange(400) for _ in range(length - 64)]


def idle(*names: str) -> dict[str, int]:
    return {name: 0 for name in names or WORKERS}


def test_route_key_covers_only_the_first_full_blocks():
    assert route_key(prompt(1, 1), BLOCK) == route_key(prompt(1, 2), BLOCK), "tails differ past 4 blocks"
    assert route_key(prompt(1, 1), BLOCK) != route_key(prompt(2, 1), BLOCK)
    assert route_key(list(range(BLOCK - 1)), BLOCK) is None, "no full block: no key"
    assert route_key(list(range(BLOCK)), BLOCK) != route_key(list(range(BLOCK + 1)) [1:], BLOCK)


def test_same_prefix_goes_to_the_same_worker():
    router = Router(capacity=8)
    chosen = {router.choose(route_key(prompt(7, tail), BLOCK), idle()) for tail in range(20)}
    assert len(chosen) == 1


def test_different_prefixes_spread_over_the_workers():
    router = Router(capacity=8)
    counts = dict.fromkeys(WORKERS, 0)
    for head in range(400):
        counts[router.choose(route_key(prompt(head, 0), BLOCK), idle())] += 1
    assert all(60 <= c <= 140 for c in counts.values()), counts


def test_an_overloaded_preferred_worker_spills_to_one_consistent_least_loaded_worker():
    router = Router(capacity=8, slack=2)
    key = route_key(prompt(3, 0), BLOCK)
    preferred = router.choose(key, idle())
    loads = {w: (5 if w == preferred else 1) for w in WORKERS}  # 5 > least 1 + slack 2
    loads[sorted(set(WORKERS) - {preferred})[0]] = 2
    second = router.choose(key, loads)
    assert second != preferred and loads[second] == 1
    assert {router.choose(route_key(prompt(3, tail), BLOCK), loads) for tail in range(10)} == {second}
    loads[preferred] = 3  # within the slack again: back to the preferred worker
    assert router.choose(key, loads) == preferred


def test_backpressure_no_worker_when_all_are_full():
    router = Router(capacity=2)
    assert router.choose(route_key(prompt(1, 1), BLOCK), {"w0": 2, "w1": 2}) is None
    assert router.choose(None, {"w0": 2, "w1": 1}) == "w1"
    assert router.choose(route_key(prompt(1, 1), BLOCK), {"w0": 2, "w1": 1}) in ("w0", "w1")
    assert router.choose(None, {}) is None


def test_losing_a_worker_moves_only_its_own_prefixes():
    router = Router(capacity=8)
    keys = [route_key(prompt(head, 0), BLOCK) for head in range(200)]
    before = [router.choose(k, idle()) for k in keys]
    after = [router.choose(k, idle("w0", "w1", "w3")) for k in keys]
    assert all(a == b for a, b in zip(after, before) if b != "w2")
    assert "w2" not in after


def test_prompt_keys_follow_the_chat_template_and_the_text(tiny_llama):
    from pagecli.cluster.prompt_keys import PromptKeys

    keys = PromptKeys(tiny_llama, block_size=BLOCK)
    system = {"role": "system", "content": "Paged attention keeps the KV cache in fixed-size blocks. " * 6}
    ask = [keys.key([system, {"role": "user", "content": question}]) for question in ("hi", "Hello world!")]
    assert ask[0] is not None and ask[0] == ask[1], "one system prompt, one key"
    assert keys.key([{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 6}]) != ask[0]
    assert keys.key("The quick brown fox jumps over the lazy dog. " * 6) is not None
    assert keys.key("hi") is None, "under one block"

    def refuse(*args, **kwargs):
        raise ValueError("the tokenizer refuses this text")

    keys.tokenizer = refuse
    assert keys.key("The quick brown fox jumps over the lazy dog. " * 6) is None, "a line's fault only loses its key"


# --- how many workers (pagecli/cluster/launch.py) ----------------------------------------------------------


def run_settings(**engine):
    from pagecli.config import RunSettings
    from pagecli.config import EngineConfig, Profile, SamplingParams

    return RunSettings(None, Profile("test", None), EngineConfig(**engine), SamplingParams())


def test_worker_plan_defaults_follow_the_cluster_and_the_threads_flag():
    from pagecli.cluster.launch import ClusterOptions, WorkerPlan, plan_workers

    assert plan_workers(ClusterOptions(), run_settings(), cpus=16, gpus=0) == WorkerPlan(16, 1, 0)
    assert plan_workers(ClusterOptions(), run_settings(threads=4), cpus=16, gpus=0) == WorkerPlan(4, 4, 0)
    assert plan_workers(ClusterOptions(threads_per_worker=2), run_settings(threads=4), 16, 0) == WorkerPlan(8, 2, 0)
    assert plan_workers(ClusterOptions(workers=3), run_settings(), cpus=16, gpus=0) == WorkerPlan(3, 1, 0)
    assert plan_workers(ClusterOptions(), run_settings(), cpus=64, gpus=4) == WorkerPlan(4, 1, 1), "one per GPU"
    assert plan_workers(ClusterOptions(), run_settings(device="cpu"), cpus=8, gpus=4) == WorkerPlan(8, 1, 0)


def test_cuda_on_a_cluster_without_gpus_is_one_sentence():
    from pagecli.cluster.launch import ClusterOptions, plan_workers
    from pagecli.errors import PagecliError

    with pytest.raises(PagecliError, match="has no GPUs"):
        plan_workers(ClusterOptions(), run_settings(device="cuda"), cpus=8, gpus=0)


def test_failure_reason_is_the_last_error_line_of_rays_text():
    from pagecli.cluster.launch import failure_reason

    text = ("ray::EngineWorker.advance() (pid=1, ip=10.0.0.1)\n  File \"x.py\", line 3, in advance\n"
            "    raise RuntimeError('boom')\nRuntimeError: boom\n")
    assert failure_reason(RuntimeError(text)) == "RuntimeError: boom"
    assert failure_reason(RuntimeError("")) == "RuntimeError"
