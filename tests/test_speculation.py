"""Speculative decoding by prompt lookup (engine/speculation.py): the same greedy output with and without
it, under every kind of step, fewer steps where the output repeats the prompt, and the pool sound."""

from __future__ import annotations

import pytest
import torch

from architecture_helpers import at_level  # noqa: F401  (a fixture)
from native_levels import COMPILED_LEVELS
from pagecli import native
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.ngram_proposer import NgramIndex
from pagecli.models.loader import load_model
from speculation_prompts import GREEDY, PROMPTS


def make_engine(folder, **config) -> Engine:
    # Drafts in batches too (the default, 1, keeps them to a lone sequence): the checks below run batches.
    # Plain decoding unless a test asks for drafts (the default, auto, takes them on the CPU's kernels).
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 512,
                "speculate_max_batch": 64, "speculate": "off", **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def outputs(engine: Engine, prompts=PROMPTS, sampling=GREEDY) -> list[tuple[tuple[int, ...], str, str]]:
    done = engine.generate(prompts, sampling)
    engine.pool.check_invariants()
    assert engine.stats().blocks_active == 0, "a finished batch left active blocks"
    return [(c.token_ids, c.text, c.finish_reason) for c in done]


def propose(token_ids, max_tokens, max_ngram=3, min_ngram=1, window=4096):
    """The lookup NgramIndex is held to: a backward scan for the latest earlier occurrence of the longest
    matching suffix n-gram (what the engine ran before the index)."""
    total = len(token_ids)
    if max_tokens <= 0 or total < min_ngram + 1:
        return []
    start = max(0, total - window)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        suffix = list(token_ids[total - n :])
        for at in range(total - n - 1, start - 1, -1):  # ends before the suffix's own last token
            if token_ids[at] == suffix[0] and list(token_ids[at : at + n]) == suffix:
                follow = list(token_ids[at + n : at + n + max_tokens])
                if follow:
                    return follow
    return []


class CursorScan:
    """The reference for NgramIndex with its copy cursor: while the tokens gained since the last proposal are
    those that followed its source, go on from there; else the scan above, whose proposal is found again in the
    tokens to place the cursor."""

    def __init__(self, max_ngram=3, min_ngram=1, window=4096):
        self.args = (max_ngram, min_ngram, window)
        self.cursor = None  # (tokens when proposed, where the proposal was copied from)

    def propose(self, token_ids, max_tokens):
        max_ngram, min_ngram, window = self.args
        total = len(token_ids)
        if self.cursor and self.cursor[0] > total:
            self.cursor = None  # cut back
        if max_tokens <= 0 or total < min_ngram + 1:
            return []
        if self.cursor:
            then, source = self.cursor
            at = source + total - then
            if total - window <= at < total and list(token_ids[then:]) == list(token_ids[source:at]):
                self.cursor = (total, at)
                return list(token_ids[at : at + max_tokens])
        self.cursor = None
        found = propose(token_ids, max_tokens, max_ngram, min_ngram, window)
        if found:  # where the scan copied from: the latest start of its n-gram's continuation
            start = max(0, total - window)
            for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
                at = next((a for a in range(total - n - 1, start - 1, -1)
                           if list(token_ids[a : a + n]) == list(token_ids[total - n :])), None)
                if at is not None:
                    self.cursor = (total, at + n)
                    break
            assert list(token_ids[self.cursor[1] : self.cursor[1] + max_tokens]) == found
        return found


def lookup(token_ids, max_tokens):
    return NgramIndex(3).propose(token_ids, max_tokens)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    for proposer in (lookup, propose):
        assert proposer([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
        assert proposer([5, 6, 7], 4) == []  # nothing repeats
        assert proposer([4, 4, 4, 4], 2) == [4]  # the latest earlier match, cut at the end of what is known
        assert proposer([1, 2, 1, 2], 0) == []


def test_prompt_lookup_goes_on_copying_from_where_it_copied():
    """The copy cursor: once a proposal came from a place, the tokens that followed it there come next while the
    output keeps following it, though the latest occurrence of the newest n-gram is another place."""
    prompt = [1, 2, 3, 4, 7, 9, 2, 3, 4, 8]
    index = NgramIndex(3)
    assert index.propose(prompt + [1], 2) == [2, 3]  # from position 1: after the only earlier 1
    # The model took both drafts and chose 4 after them, as position 3 holds: the copy goes on with 7 and 9,
    # where the latest 2, 3, 4 (at 6) is followed by 8.
    assert index.propose(prompt + [1, 2, 3, 4], 2) == [7, 9]
    assert propose(prompt + [1, 2, 3, 4], 2) == [8, 1]
    # The output left the source (5, not 7): the lookup again.
    assert index.propose(prompt + [1, 2, 3, 4, 5], 2) == propose(prompt + [1, 2, 3, 4, 5], 2)


@pytest.mark.parametrize("config", [
    {}, {"num_speculative_tokens": 1}, {"num_speculative_tokens": 8},
    {"max_num_batched_tokens": 6},  # drafts cut by the token budget
    {"num_blocks": 40},  # preemption
    {"enable_prefix_caching": False},
], ids=["k4", "k1", "k8", "tiny budget", "preemption", "no prefix caching"])
def test_greedy_output_is_the_same_with_and_without_speculation(tiny_model_factory, config):
    folder = tiny_model_factory("llama")
    plain = outputs(make_engine(folder, **config))
    engine = make_engine(folder, speculate="ngram", **config)
    assert outputs(engine) == plain
    assert engine.speculator.passes > 0, "no drafts were checked"


def test_stops_and_lengths_end_a_speculated_run_where_plain_decoding_ends_it(tiny_model_factory):
    folder = tiny_model_factory("llama")
    engine = make_engine(folder)
    full = engine.generate([PROMPTS[0]], GREEDY)[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    for sampling in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                     SamplingParams(temperature=0, max_tokens=40, stop=(stop,), ignore_eos=True)):
        assert outputs(make_engine(folder, speculate="ngram"), [PROMPTS[0]], sampling) == \
            outputs(make_engine(folder), [PROMPTS[0]], sampling)


def test_sampled_requests_run_beside_speculating_ones_unchanged(tiny_model_factory):
    folder = tiny_model_factory("llama")
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    plain, fast = make_engine(folder), make_engine(folder, speculate="ngram")
    for engine in (plain, fast):
        engine.add_request(PROMPTS[0], GREEDY, request_id="g")
        engine.add_request(PROMPTS[1], sampled, request_id="s")
    results = []
    for engine in (plain, fast):
        texts: dict[str, list[int]] = {"g": [], "s": []}
        while engine.has_unfinished:
            for event in engine.step():
                texts[event.request_id].extend(event.token_ids)
        results.append(texts)
    assert results[0] == results[1]
    assert fast.speculator.passes > 0, "no drafts were checked"


def test_speculation_takes_fewer_steps_where_the_output_repeats(tiny_model_factory):
    folder = tiny_model_factory("llama")
    plain, fast = make_engine(folder), make_engine(folder, speculate="ngram")
    outputs(plain, [PROMPTS[0]])
    outputs(fast, [PROMPTS[0]])
    assert fast.speculator.accepted > 0
    assert fast.stats().num_steps < plain.stats().num_steps


@pytest.mark.parametrize("level", COMPILED_LEVELS)
def test_checking_steps_run_in_the_one_call_decode_step_with_plain_decodings_output(level, at_level,  # noqa: F811
                                                                                     tiny_model_factory):
    """On the compiled levels a checking step (each sequence's last token and its drafts) runs in the
    one-call decode step, every token a decode row over its causal context: plain decoding's bits."""
    if not native.enabled():
        pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off")
    at_level(level)
    folder = tiny_model_factory("llama")
    plain = outputs(make_engine(folder, attention="auto"))
    engine = make_engine(folder, attention="auto", speculate="ngram")
    step = engine.loaded.model.decode_step
    assert step is not None, "a tiny llama in float32 has a one-call decode step on a compiled level"
    rows_per_call: list[int] = []

    class Spy:  # DecodeStep is a compiled class: wrap the instance
        def forward(self, h, *args):
            rows_per_call.append(h.shape[0])
            return step.forward(h, *args)

    engine.loaded.model.decode_step = Spy()
    assert outputs(engine) == plain
    assert engine.speculator.passes > 0
    assert max(rows_per_call) > len(PROMPTS), "no checking step (more rows than sequences) ran in the one call"


@pytest.mark.parametrize("attention", ["torch", "auto"])
def test_seeded_sampled_requests_take_drafts_and_draw_plain_samplings_tokens(tiny_model_factory, attention):
    """A sampled sequence's choice at each checked position is drawn with the random word plain decoding
    uses there (the words past the first disagreement go back), so a seeded request gives the same tokens
    with and without drafts: speculative sampling's rule for a draft that is one token for sure."""
    folder = tiny_model_factory("llama")
    sampled = SamplingParams(temperature=0.02, top_p=0.95, top_k=50, seed=11, max_tokens=60, ignore_eos=True)
    plain = outputs(make_engine(folder, attention=attention), sampling=sampled)
    engine = make_engine(folder, attention=attention, speculate="ngram")
    assert outputs(engine, sampling=sampled) == plain
    assert engine.speculator.accepted > 0, "no sampled draft was accepted: the test checks nothing"
    assert engine.speculator.accepted < engine.speculator.proposed, "no draft was rejected: nothing handed back"


def test_a_sequence_whose_drafts_keep_failing_stops_drafting(tiny_model_factory, monkeypatch):
    """Proposals that are always wrong (a token the model never picks): after a pass or two the sequence's
    acceptance estimate is below what a row costs and it takes no more drafts, only free shadow guesses;
    the output is plain decoding's."""
    from pagecli.engine import ngram_proposer

    folder = tiny_model_factory("llama")
    sampling = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = outputs(make_engine(folder), [PROMPTS[1]], sampling)
    never = next(t for t in range(5, 1000) if all(t not in ids for ids, _, _ in plain))  # never chosen
    monkeypatch.setattr(ngram_proposer.NgramIndex, "propose", lambda self, tokens, room: [never] * room)
    # The row cost held at 0.2 (the avx512 level's, measured): timed on a loaded machine it can fall to its floor
    # (0.02), where even a low acceptance pays for a draft, and the count below would measure the machine, not
    # the budget; at 0.2 the prior (one half) takes a draft.
    from pagecli.engine import speculation
    from pagecli.engine.draft_budget import RowCost

    monkeypatch.setattr(speculation, "RowCost", lambda prior, measure: RowCost(0.2, measure=False))
    engine = make_engine(folder, speculate="ngram")
    assert outputs(engine, [PROMPTS[1]], sampling) == plain
    spec = engine.speculator
    assert spec.accepted == 0
    assert 1 <= spec.passes <= 2, spec.passes  # the prior's one draft, maybe a second, then none


def test_the_draft_count_maximises_expected_tokens_per_step_cost():
    from pagecli.engine.draft_budget import (MAX_PASS_COST, MAX_ROW_COST, MIN_ROW_COST, PASS_COST, DraftBudget,
                                             RowCost, best_length)

    assert best_length(1.0, 0.45, 4) == 4  # copying for sure: every draft pays while a row costs < 1 step
    assert best_length(0.0, 0.02, 4) == 0
    assert best_length(0.3, 0.45, 4) == 0  # (1 + 0.3) / 1.45 < 1
    assert best_length(0.6, 0.45, 4, pass_cost=0.0) == 1  # 1.6 / 1.45 beats 1.96 / 1.9, and the hurdle
    assert best_length(0.6, 0.45, 4) == 0  # 1.6 / 1.57: not 5% better than a plain step
    assert best_length(0.9, 0.05, 8) == 8
    assert best_length(1.0, MAX_ROW_COST, 1, MAX_PASS_COST) == 1  # copying for sure drafts at the costs' bounds
    assert best_length(0.54, 0.46, 4) == 0  # 1.54 / 1.46 would pay but for the pass's own cost (0.98x measured)
    assert best_length(0.37, 0.24, 4, 0.12) == 0  # sampled open text on Zen 5: break-even, not taken
    budget = DraftBudget()
    for _ in range(6):
        budget.after_pass(0, 2)  # only the first rejection is an observation
    assert budget.acceptance < 0.2 and budget.length(0.45, 4) == 0
    for position in range(10):  # shadow guesses that come true bring the drafts back
        budget.guess(position, 7)
        budget.settle_guess([7] * (position + 1))
    assert budget.acceptance > 0.85 and budget.length(0.45, 4) >= 2
    cost = RowCost(0.45, measure=True)
    assert cost.value == 0.45  # the prior until two row counts are timed
    for rows, seconds in ((1, 0.010), (3, 0.012), (5, 0.014), (1, 0.010)):
        cost.observe(rows, seconds)
    assert abs(cost.value - 0.1) < 1e-9  # 1 ms a row over a 10 ms one-row step
    assert abs(cost.pass_cost) < 1e-9  # the passes' line meets the plain step at one row
    cost.observe(2, 0.5)  # a wild sample is held within the bounds
    assert MIN_ROW_COST <= cost.value <= MAX_ROW_COST and 0 <= cost.pass_cost <= MAX_PASS_COST
    jump = RowCost(0.45, measure=True)
    assert jump.pass_cost == PASS_COST  # the prior until two counts of checking passes are timed
    for rows, seconds in ((1, 0.010), (2, 0.0132), (4, 0.0152)):  # 2.2 ms more for a pass, then 1 ms a row
        jump.observe(rows, seconds)
    assert abs(jump.value - 0.1) < 1e-9 and abs(jump.pass_cost - 0.22) < 1e-9
    assert RowCost(0.05, measure=False).value == 0.05


def test_in_a_batch_a_draft_row_costs_more_of_each_sequences_share_of_the_step():
    from pagecli.engine.draft_budget import batch_costs, best_length

    assert batch_costs(0.2, 0.12, 1) == (0.2, 0.12)  # one sequence: as timed
    r, c = batch_costs(0.2, 0.12, 4)  # a plain step of 4 rows is 1.6 one-row steps, 0.4 for each sequence
    assert abs(r - 0.5) < 1e-9 and abs(c - 0.075) < 1e-9
    costs = [batch_costs(0.2, 0.12, b)[0] for b in (1, 2, 4, 8, 64)]
    assert costs == sorted(costs) and costs[-1] < 1.0  # dearer with every sequence, never above a whole step
    assert batch_costs(1.0, 0.12, 8)[0] == 1.0  # rows that cost a step each: a batch shares nothing
    # Open text's acceptance drafts alone but not among 8 (sampled open text in batches ran 0.92x before the
    # costs were scaled, AMD EPYC Zen 4); a copying stretch still drafts there.
    r8, c8 = batch_costs(0.2, 0.12, 8)
    assert best_length(0.6, 0.2, 8, 0.12) > 0 and best_length(0.6, r8, 8, c8) == 0
    assert best_length(0.95, r8, 8, c8) > 0


def test_in_a_batch_the_costs_come_from_the_steps_timed_at_that_batch_size_once_there_are_enough():
    from types import SimpleNamespace

    from pagecli.engine.draft_budget import RowCost, batch_costs
    from pagecli.engine.speculation import Speculator

    def close(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return all(abs(x - y) < 1e-9 for x, y in zip(a, b))

    cost = RowCost(0.45, measure=True)
    for rows, seconds in ((1, 0.010), (3, 0.012), (5, 0.014)):  # one sequence: 1 ms a row over 10 ms, c = 0
        cost.observe(rows, seconds)
    scaled = batch_costs(0.1, 0.0, 4)
    assert close(cost.costs(4), scaled)  # nothing timed with 4 sequences: the one-sequence figures, scaled
    cost.observe(4, 0.0114, sequences=4)  # a plain step of 4 (Zen 4's bf16 batches: 11.4 ms)
    cost.observe(6, 0.0149, sequences=4)
    assert close(cost.costs(4), scaled)  # one count of checking passes: not yet a line
    cost.observe(10, 0.0197, sequences=4)  # 1.2 ms a row, the line 1.1 ms over the plain step at 4 rows
    r, c = cost.costs(4)
    assert abs(r - 0.0012 * 4 / 0.0114) < 1e-9 and abs(c - 0.0011 / 0.0114) < 1e-9
    assert r > scaled[0]  # what the scaling missed: the batch's draft rows cost more than one sequence's said
    assert close(cost.costs(1), (0.1, 0.0)) and close(cost.costs(2), batch_costs(0.1, 0.0, 2))  # the others unchanged
    cost.observe(12, 1.0, sequences=4)  # a wild sample is held within the bounds
    r, c = cost.costs(4)
    assert r <= 1.0 and 0 <= c <= 0.3

    def item(prompt: int, tokens: int, new: int, drafts: int = 0) -> SimpleNamespace:
        seq = SimpleNamespace(num_prompt_tokens=prompt, num_tokens=tokens, num_draft=drafts)
        return SimpleNamespace(seq=seq, num_new_tokens=new)

    decoding = [item(5, 9, 1), item(5, 12, 4, drafts=3)]
    assert Speculator.timed_rows(decoding) == (2, 5)  # every sequence decoding: timed, drafts counted
    assert Speculator.timed_rows([*decoding, item(8, 8, 8)]) is None  # a prompt's chunk in the step: not


def test_a_sequence_drafts_at_most_four_until_a_pass_accepts_all_then_its_cap_doubles_up_to_k():
    from pagecli.engine.draft_budget import FIRST_CAP, DraftBudget

    budget = DraftBudget()
    for _ in range(10):  # copying for sure: the estimate near 1
        budget.after_pass(1, 1)
    budget.cap = FIRST_CAP
    assert budget.length(0.05, 8) == FIRST_CAP  # K = 8, the sequence's own cap first
    budget.after_pass(FIRST_CAP, FIRST_CAP)  # all of its cap accepted
    assert budget.length(0.05, 8) == 8
    budget.after_pass(8, 8)
    assert budget.length(0.05, 8) == 8  # K bounds it
    budget.after_pass(3, 8)  # a rejection: back to the first cap
    assert budget.cap == FIRST_CAP
    budget.after_pass(2, 2)  # all accepted but fewer than the cap: no doubling
    assert budget.cap == FIRST_CAP


def test_no_drafts_while_more_sequences_run_than_speculate_max_batch(tiny_model_factory):
    folder = tiny_model_factory("llama")
    plain = outputs(make_engine(folder))
    engine = make_engine(folder, speculate="ngram", speculate_max_batch=1)
    assert outputs(engine) == plain
    assert engine.speculator.passes == 0  # four prompts ran together to the end (ignore_eos, one length)
    alone = make_engine(folder, speculate="ngram", speculate_max_batch=1)
    assert outputs(alone, [PROMPTS[0]]) == [plain[0]]
    assert alone.speculator.passes > 0


def test_auto_takes_drafts_where_checking_runs_in_the_one_call_decode_step(tiny_model_factory):
    """--speculate auto (the default) is ngram on a CPU with the compiled kernels and a model they run in one
    call, and gives plain decoding's output; off where a checking step would not be plain decoding's bits."""
    from types import SimpleNamespace

    from pagecli.engine.speculation import resolve_method

    if not native.enabled():
        pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off")
    folder = tiny_model_factory("llama")
    plain = outputs(make_engine(folder, speculate_max_batch=1), [PROMPTS[0]])
    engine = make_engine(folder, speculate="auto", speculate_max_batch=1)
    assert EngineConfig().speculate == "auto"
    assert engine.speculate == "ngram" and engine.speculator is not None
    assert outputs(engine, [PROMPTS[0]]) == plain
    assert engine.speculator.passes > 0
    model, backend = engine.loaded.model, engine.backend
    auto = EngineConfig(speculate="auto")
    assert resolve_method(auto, model, backend) == "ngram"
    assert resolve_method(auto, SimpleNamespace(decode_step=None), backend) == "off"  # no one-call step
    assert resolve_method(auto, model, SimpleNamespace(cpu_ops=None)) == "off"  # a GPU's or PyTorch's backend
    assert resolve_method(EngineConfig(speculate="auto", num_speculative_tokens=16), model, backend) == "off"
    assert resolve_method(EngineConfig(speculate="ngram"), SimpleNamespace(decode_step=None), None) == "ngram"
    assert resolve_method(EngineConfig(speculate="off"), model, backend) == "off"
    assert resolve_method(auto, model, backend, rows_exact=False) == "off"  # products that sum rows together


def test_auto_leaves_drafts_off_where_the_products_do_not_give_each_row_its_bits_alone(tiny_model_factory,
                                                                                      at_level):
    """A bf16 model on the avx2 level's kernels runs PyTorch's (oneDNN's) products, which sum a row otherwise
    among a few rows than alone: checking passes there changed sampled outputs (batches of 2, AMD EPYC Zen 4
    forced to avx2, 7 of 30 requests), so auto leaves drafts off; float32's panels keep them. And a forced avx2
    level takes float32 for dtype auto, as an AVX2 CPU does (native.cpu_has_bf16)."""
    if not native.enabled() or "avx2" not in COMPILED_LEVELS:
        pytest.skip("no avx2 kernels here")
    at_level("avx2")
    folder = tiny_model_factory("llama")
    common = {"device": "cpu", "num_blocks": 256, "block_size": 4, "disk_cache": False}
    bf16 = Engine(str(folder), EngineConfig(dtype="bfloat16", **common))
    assert bf16.plan.decoder == "float" and not bf16.plan.rows_exact(native.cpu_ops())
    assert bf16.speculate == "off"
    assert Engine(str(folder), EngineConfig(dtype="bfloat16", speculate="ngram", **common)).speculate == "ngram"
    f32 = Engine(str(folder), EngineConfig(dtype="auto", **common))
    assert f32.plan.dtype == torch.float32 and f32.speculate == "ngram"


def test_the_ngram_index_proposes_what_a_scan_does():
    """NgramIndex (kept as a sequence grows) against CursorScan (a scan and the copy cursor), at every length of
    random token runs over small vocabularies (many repeats), several draft counts, n-gram sizes and windows; the
    runs often copy an earlier stretch for a while, so the cursor is followed and left."""
    import random

    rng = random.Random(0)
    for trial in range(60):
        vocab, max_ngram, window = rng.choice([2, 3, 5, 40]), rng.choice([1, 2, 3, 5]), rng.choice([6, 20, 4096])
        index, scan = NgramIndex(max_ngram, 1, window), CursorScan(max_ngram, 1, window)
        tokens: list[int] = []
        copying = -1
        while len(tokens) < 120:
            for _ in range(rng.choice([1, 1, 2, 3])):  # a step's tokens: one, or a pass's accepted drafts and one
                if copying >= 0 and rng.random() < 0.8:
                    tokens.append(tokens[copying])
                    copying += 1
                else:
                    tokens.append(rng.randrange(vocab))
                    copying = rng.randrange(len(tokens)) if rng.random() < 0.3 else -1
            wanted = rng.choice([0, 1, 4, 8])
            assert index.propose(tokens, wanted) == scan.propose(tokens, wanted), (trial, tokens)
    cut = NgramIndex(3)
    cut.propose([1, 2, 3, 1, 2], 2)
    assert cut.propose([7, 8, 7], 2) == propose([7, 8, 7], 2)  # cut back and grown again: rebuilt
