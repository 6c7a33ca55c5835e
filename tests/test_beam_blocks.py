"""Beam search on shared blocks: exact block accounting at every beam step, and outputs that preemption,
chunking and a tight pool never change.

After the first beam step every beam references every prompt block; after each step the pool's ref counts
equal the number of beams holding each block (pool_checks), a dropped beam's own blocks are free again, and
when the search ends nothing is left behind (the leak check also runs after every test).
"""

from __future__ import annotations

import pytest

from pagecli.config import SamplingParams
from pagecli.errors import PagecliError, RequestError
from pool_checks import check_engine_pool
from test_beam_parity import PROMPT, beam_params, engine_for

BLOCK_SIZE = 4
PROMPT_BLOCKS = -(-len(PROMPT) // BLOCK_SIZE)
WIDTH = 4


def live_beams(engine, request_id="r"):
    group = engine.beams._groups.get(request_id)
    return list(group.beams) if group else []


def test_after_the_first_beam_step_every_beam_shares_every_prompt_block(tiny_llama):
    engine = engine_for(tiny_llama)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, beam_width=WIDTH), "r")
    while len(live_beams(engine)) < WIDTH:
        engine.step()
    beams = live_beams(engine)
    table = beams[0].block_table
    assert len(table) == PROMPT_BLOCKS and all(b.block_table == table for b in beams)
    assert [engine.pool.blocks[b].ref_count for b in table] == [WIDTH] * PROMPT_BLOCKS
    assert engine.pool.counts().active == PROMPT_BLOCKS
    assert engine.stats().fork_block_shares == (WIDTH - 1) * PROMPT_BLOCKS
    for _ in engine.stream():
        pass


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_each_beam_step_keeps_ref_counts_exact_and_frees_what_a_dropped_beam_held(tiny_llama, prefix_caching):
    engine = engine_for(tiny_llama, enable_prefix_caching=prefix_caching)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, beam_width=WIDTH), "r")
    drops = 0
    while engine.has_unfinished:
        before = live_beams(engine)
        own = {id(b): [x for x in b.block_table if engine.pool.blocks[x].ref_count == 1] for b in before}
        engine.step()
        check_engine_pool(engine)  # every block's ref count equals the beams holding it; hash chains hold
        tables = [s.block_table for s in engine.scheduler.running]
        assert engine.pool.counts().active == len({b for t in tables for b in t})
        for beam in before:
            if beam.finish_reason == "beam_dropped":
                drops += 1
                assert all(engine.pool.blocks[x].ref_count == 0 for x in own[id(beam)]), "a dropped beam kept blocks"
    assert drops > 0, "some beam was meant to be dropped"
    assert engine.pool.counts().active == 0
    assert engine.stats().blocks_saved_by_sharing > 0


def test_beams_hold_fewer_blocks_than_separate_copies_would(tiny_llama):
    engine = engine_for(tiny_llama, enable_prefix_caching=False)
    max_tokens = 24
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                              beam_width=WIDTH), "r")
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, engine.pool.counts().active)
    separate = WIDTH * -(-(len(PROMPT) + max_tokens) // BLOCK_SIZE)
    assert peak < separate
    # Each beam's own blocks plus the prompt's, plus at most one partial block per beam.
    assert peak <= PROMPT_BLOCKS + WIDTH * -(-max_tokens // BLOCK_SIZE) + WIDTH


def run(folder, requests, **config):
    """{(request id, index): (tokens, score)} for every completion, and the engine."""
    engine = engine_for(folder, **config)
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id)
    tokens, done = {}, {}
    for ev in engine.stream():
        key = (ev.request_id, ev.index)
        tokens.setdefault(key, []).extend(ev.token_ids)
        if ev.finished:
            done[key] = (tuple(tokens[key]), ev.score)
    return done, engine


def assert_same_outputs(got, expected) -> None:
    """Same tokens for every completion; scores equal up to float32 rounding (a beam recomputed after
    preemption gets its log-probs from a prefill, not a decode step, which sums in another order)."""
    assert {key: tokens for key, (tokens, _) in got.items()} == {key: tokens for key, (tokens, _) in expected.items()}
    for key, (_, score) in expected.items():
        assert got[key][1] == pytest.approx(score, abs=1e-4)


# A long plain request that grows while two beam searches run, so a small pool must preempt.
WORKLOAD = [("old", list(range(60, 110)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
            ("beams", PROMPT[:6], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, beam_width=3, n=3)),
            ("more", PROMPT[3:], beam_params(2, 16, n=2, length_penalty=0.5))]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_pool_changes_no_beam(tiny_llama, prefix_caching):
    roomy, _ = run(tiny_llama, WORKLOAD, enable_prefix_caching=prefix_caching)
    squeezed, engine = run(tiny_llama, WORKLOAD, num_blocks=24, enable_prefix_caching=prefix_caching)
    assert_same_outputs(squeezed, roomy)
    assert engine.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"


def test_beams_computed_in_different_steps_give_the_same_beams(tiny_llama):
    roomy, _ = run(tiny_llama, WORKLOAD)
    chunked, _ = run(tiny_llama, WORKLOAD, max_num_batched_tokens=2)  # a group's beams never fit one step
    assert_same_outputs(chunked, roomy)


def test_aborting_a_beam_search_frees_every_block(tiny_llama):
    engine = engine_for(tiny_llama)
    engine.add_request(PROMPT, beam_params(WIDTH, 40), "r")
    while len(live_beams(engine)) < WIDTH:
        engine.step()
    engine.step()
    engine.abort("r")
    assert not engine.has_unfinished and engine.pool.counts().active == 0 and not engine.beams._groups


def test_a_beam_search_the_engine_cannot_hold_is_refused(tiny_llama):
    small = engine_for(tiny_llama, num_blocks=12)
    with pytest.raises(RequestError, match="may need 40 KV blocks at once; the pool has 12"):
        small.add_request(PROMPT, beam_params(4, 27))
    few_seats = engine_for(tiny_llama, max_num_seqs=2)
    with pytest.raises(RequestError, match="beam_width 3 is more than max_num_seqs 2"):
        few_seats.add_request(PROMPT, beam_params(3, 5))


@pytest.mark.parametrize("fields, message", [
    ({"beam_width": 2, "temperature": 0.7}, "does not sample: set temperature 0"),
    ({"beam_width": 2, "temperature": 0, "n": 3}, "n 3 is more than beam_width 2"),
    ({"beam_width": 0}, "beam_width must be between 1 and 256"),
    ({"beam_width": 2, "temperature": 0, "stop": ["x"]}, "stop strings are not supported with beam search"),
    ({"beam_width": 2, "temperature": 0, "repetition_penalty": 1.2}, "repetition_penalty is not supported"),
    ({"early_stopping": "sometimes"}, "early_stopping must be true, false or \"never\""),
    ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
])
def test_beam_settings_are_checked(fields, message):
    with pytest.raises(PagecliError, match=message):
        SamplingParams(**fields)


def test_beam_width_one_is_plain_decoding(tiny_llama):
    engine = engine_for(tiny_llama)
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))
    one = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, beam_width=1, length_penalty=2.0))
    assert [c.token_ids for c in one] == [c.token_ids for c in plain] and one[0].score is None


def test_a_beam_preempted_after_its_row_was_in_still_forks_and_drops_correctly(tiny_llama, monkeypatch):
    """Beams computed in different steps (a budget of 2 tokens), and each parked beam preempted once before
    the next step: group steps then fork from, and drop, parents that hold no blocks and wait to be
    recomputed. (Preempting a beam every time it parks would recompute it forever: it waits at the front.)"""
    from pagecli.engine.beam_groups import BeamGroups
    from pagecli.engine.sequence import SequenceStatus

    waiting_parents = []
    place = BeamGroups._place
    monkeypatch.setattr(BeamGroups, "_place", lambda self, parent, forks: (
        waiting_parents.append(parent.status) if forks and parent.status is SequenceStatus.WAITING else None,
        place(self, parent, forks))[1])
    requests = [("r", PROMPT, beam_params(WIDTH, 12, n=WIDTH))]
    roomy, _ = run(tiny_llama, requests)
    engine = engine_for(tiny_llama, max_num_batched_tokens=2)
    engine.add_request(PROMPT, beam_params(WIDTH, 12, n=WIDTH), "r")
    tokens, done = {}, {}
    preempted = set()
    while engine.has_unfinished:
        scheduler = engine.scheduler
        for beam in [s for s in scheduler.running if s.num_uncomputed_tokens == 0 and id(s) not in preempted]:
            preempted.add(id(beam))
            scheduler.running.remove(beam)
            scheduler._preempt(beam)
        for ev in engine.step():
            tokens.setdefault((ev.request_id, ev.index), []).extend(ev.token_ids)
            if ev.finished:
                done[(ev.request_id, ev.index)] = (tuple(tokens[(ev.request_id, ev.index)]), ev.score)
        check_engine_pool(engine)
    assert_same_outputs(done, roomy)
    assert waiting_parents, "a parent was meant to fork while it waited to be recomputed"
