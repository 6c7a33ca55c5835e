"""Parallel sampling (n > 1) on shared blocks: exact block accounting, read from the block tables.

After the fork every candidate references every prompt block (ref count n, the partial last block
included) and the pool holds the prompt once; the first write into the shared partial block gives
each writer but the last its own copy (copy-on-write, one block each); at every step the pool holds
exactly the distinct blocks the tables name, within one block per candidate of the prompt's blocks
plus each candidate's own output blocks; nothing is left behind (the leak check runs after each test).
"""

from __future__ import annotations

import pytest
import torch

from pagecli.attention.block_copy import copy_blocks
from pagecli.config import SamplingParams
from test_forks_output import make_engine

BLOCK_SIZE = 4
PROMPT = list(range(40, 54))  # 14 tokens: 3 full blocks of 4 and a partial block of 2
PROMPT_BLOCKS = -(-len(PROMPT) // BLOCK_SIZE)
N = 8


def candidates_of(engine, request_id="r"):
    running = [s for s in engine.scheduler.running if s.request_id == request_id]
    return sorted(running, key=lambda s: s.candidate_index)


def step_until_forked(engine) -> list:
    while not engine.step():
        pass
    return candidates_of(engine)


def ref_counts(engine, table) -> list[int]:
    return [engine.pool.blocks[b].ref_count for b in table]


def test_after_the_fork_every_candidate_shares_every_prompt_block(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=N), "r")
    candidates = step_until_forked(engine)
    assert [s.candidate_index for s in candidates] == list(range(N))
    table = candidates[0].block_table
    assert len(table) == PROMPT_BLOCKS
    assert all(s.block_table == table for s in candidates)
    assert ref_counts(engine, table) == [N] * PROMPT_BLOCKS
    counts = engine.pool.counts()
    assert (counts.active, counts.shared) == (PROMPT_BLOCKS, PROMPT_BLOCKS)
    stats = engine.stats(include_block_states=True)
    assert stats.fork_block_shares == (N - 1) * PROMPT_BLOCKS
    assert stats.block_states.count("shared") == PROMPT_BLOCKS  # what the pool panel draws as shared
    for _ in engine.stream():
        pass


def test_the_first_write_copies_the_shared_partial_block_once_per_writer_but_the_last(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=N), "r")
    candidates = step_until_forked(engine)
    original_partial = candidates[0].block_table[-1]
    engine.step()  # every candidate writes its first output token into the prompt's partial block
    full = candidates[0].block_table[:-1]
    assert all(s.block_table[:-1] == full for s in candidates)
    assert ref_counts(engine, full) == [N] * (PROMPT_BLOCKS - 1)
    partials = [s.block_table[-1] for s in candidates]
    assert len(set(partials)) == N and ref_counts(engine, partials) == [1] * N
    assert partials[-1] == original_partial, "the last writer keeps the block once the others have copied it"
    assert engine.pool.counts().active == PROMPT_BLOCKS + N - 1
    stats = engine.stats()
    assert stats.cow_block_copies == N - 1
    assert stats.blocks_saved_by_sharing == (N - 1) * PROMPT_BLOCKS - (N - 1)
    for _ in engine.stream():
        pass
    assert engine.stats().to_dict()["blocks_saved_by_sharing"] == (N - 1) * (PROMPT_BLOCKS - 1)


def test_a_prompt_that_fills_its_last_block_needs_no_copy(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE)
    engine.add_request(PROMPT[:12], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=N), "r")
    for _ in engine.stream():
        pass
    assert engine.stats().cow_block_copies == 0
    assert engine.stats().blocks_saved_by_sharing == (N - 1) * 3


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 30])
def test_blocks_in_use_are_the_tables_distinct_blocks_within_one_per_candidate_of_the_bound(tiny_llama, max_tokens):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True, n=N),
                       "r")
    peak = 0
    while engine.has_unfinished:
        engine.step()
        tables = [s.block_table for s in engine.scheduler.running]
        active = engine.pool.counts().active
        assert active == len({b for table in tables for b in table})
        own_blocks = sum(-(-max(0, s.num_computed_tokens - len(PROMPT)) // BLOCK_SIZE) for s in engine.scheduler.running)
        assert PROMPT_BLOCKS + own_blocks <= active + len(tables) - 1 or not tables
        assert active <= PROMPT_BLOCKS + own_blocks + len(tables)
        peak = max(peak, active)
    separate_copies = N * -(-(len(PROMPT) + max_tokens - 1) // BLOCK_SIZE)
    assert peak <= PROMPT_BLOCKS + N * -(-(max_tokens - 1) // BLOCK_SIZE) + N
    assert peak < separate_copies


def test_preempted_candidates_leave_no_block_behind(tiny_llama):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE, num_blocks=12)
    engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True, n=4), "r")
    while engine.has_unfinished:
        engine.step()
        engine.pool.check_invariants()
        waiting = {s.candidate_index for s in engine.scheduler.waiting}
        assert all(not s.block_table for s in engine.scheduler.waiting), f"waiting candidates {waiting} hold blocks"
    assert engine.stats().num_preemptions > 0
    assert engine.pool.counts().active == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_backend_copies_blocks_in_every_layer(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        from pagecli.attention.triton_backend import TritonAttentionBackend as Backend
    else:
        from pagecli.attention.reference_backend import ReferenceAttentionBackend as Backend
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    kv = torch.randn(3, 2, 6, 4, 2, 8, device=device)
    before = kv.clone()
    Backend().copy_blocks(kv, [1, 4], [5, 1])  # block 1 is a source and a destination: it gives its old data
    assert torch.equal(kv[:, :, 5], before[:, :, 1]) and torch.equal(kv[:, :, 1], before[:, :, 4])
    assert torch.equal(kv[:, :, [0, 2, 3, 4]], before[:, :, [0, 2, 3, 4]])


def test_copy_blocks_with_nothing_to_copy_touches_nothing():
    kv = torch.zeros(1, 2, 2, 4, 1, 2)
    copy_blocks(kv, [], [])
    assert not kv.any()


def test_a_forked_group_is_preempted_as_a_unit_when_another_request_needs_blocks(tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE, num_blocks=16, enable_prefix_caching=False)
    scheduler = engine.scheduler
    preemptions = []  # (needy request, preempted sequences, the group's running sequences before)
    original = scheduler._preempt_newest

    def recording(needy):
        group = [s for s in scheduler.running if s.request_id == scheduler.running[-1].request_id]
        victims = original(needy)
        preemptions.append((needy.request_id, victims, group))
        return victims

    monkeypatch.setattr(scheduler, "_preempt_newest", recording)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "old")
    engine.step()
    engine.add_request(PROMPT[:6], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=4), "group")
    for _ in engine.stream():
        pass
    across = [(victims, group) for needy, victims, group in preemptions if needy != victims[0].request_id]
    assert across, "the old request was meant to need the group's blocks"
    assert any(len(group) > 1 for _, group in across), "a forked group was meant to be preempted"
    assert all(victims == group for victims, group in across)


def test_a_forked_prompt_goes_to_the_disk_store_once_and_is_found_there_later(tiny_llama, tmp_path):
    store = {"disk_cache": True, "disk_cache_dir": str(tmp_path / "store"), "disk_cache_all_prompts": True}
    engine = make_engine(tiny_llama, block_size=BLOCK_SIZE, **store)
    queued = []
    persist = engine.persist_prefix
    engine.persist_prefix = lambda token_ids, lora=None: queued.append(persist(token_ids, lora)) or queued[-1]
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=N))
    engine.close()
    assert queued == [len(PROMPT) // BLOCK_SIZE]  # candidate 0 stores the prompt's full blocks; no one else asks
    later = make_engine(tiny_llama, block_size=BLOCK_SIZE, **store)
    later.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, n=2))
    later.close()
    assert later.stats().prefix_disk_hit_tokens == (len(PROMPT) // BLOCK_SIZE) * BLOCK_SIZE
