"""Speculative decoding with a draft model (--speculate draft, engine/draft_model.py): the same output with and
without it whatever the draft proposes, the draft's mirrors in step with their sequences and its pool given back,
its cost in the draft budget, and the settings refused where they cannot work."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from pagecli.cli.generate import _speculation as speculation_summary
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.engine.draft_budget import (MAX_PROBE_EVERY, PROBE_DRAFTS, DraftBudget, ProbeClock, RowCost,
                                         draft_step_share)
from pagecli.errors import PagecliError
from pagecli.models.loader import load_model
from pagecli.ui.progress import load_summary
from speculation_prompts import GREEDY, PROMPTS


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def every_draft(monkeypatch):
    """Every eligible sequence takes all the drafts it has room for (the budget's choice depends on timings: the
    checks below are about what drafts do, not whether they pay)."""
    monkeypatch.setattr(DraftBudget, "length", lambda self, row_cost, limit, pass_cost=0.0: limit)


@pytest.fixture
def models(tiny_model_factory):
    """(main, the same model as its draft, another random model with the same tokenizer)."""
    main = tiny_model_factory("llama")
    return main, main, tiny_model_factory("llama", seed=1)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 4, "num_blocks": 512,
                "speculate_max_batch": 64, "speculate": "off", **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def drafting(folder, draft, **config) -> Engine:
    return make_engine(folder, speculate="draft", draft_model=str(draft), **config)


def outputs(engine: Engine, prompts=PROMPTS, sampling=GREEDY) -> list[tuple[tuple[int, ...], str, str]]:
    done = engine.generate(prompts, sampling)
    assert engine.stats().blocks_active == 0, "a finished batch left active blocks"
    assert_no_draft_blocks(engine)
    return [(c.token_ids, c.text, c.finish_reason) for c in done]


def assert_no_draft_blocks(engine: Engine) -> None:
    drafter = engine.drafter
    if drafter is not None:
        drafter.pool.check_invariants()
        assert not drafter.mirrors, "a mirror outlived its sequence"
        assert drafter.pool.counts().free == drafter.pool.num_blocks, "draft blocks were left behind"


@pytest.mark.parametrize("config", [
    {"num_speculative_tokens": 1}, {}, {"num_speculative_tokens": 8},
    {"max_num_batched_tokens": 6},  # drafts cut by the token budget; the draft's prompt in chunks of 6
    {"num_blocks": 40},  # preemption
    {"enable_prefix_caching": False},
], ids=["k1", "k4", "k8", "tiny budget", "preemption", "no prefix caching"])
@pytest.mark.parametrize("which", ["same", "other"])
def test_greedy_output_is_the_same_with_a_draft_model(models, every_draft, config, which):
    main, same, other = models
    plain = outputs(make_engine(main, **config))
    engine = drafting(main, same if which == "same" else other, **config)
    assert outputs(engine) == plain
    spec = engine.speculator
    assert spec.passes > 0, "no drafts were checked"
    if which == "same":  # the draft is the main model (in its own dtype): it agrees nearly always
        assert spec.accepted >= 0.8 * spec.proposed, (spec.accepted, spec.proposed)
    else:
        assert spec.accepted < spec.proposed, "another random model should be wrong sometimes"
    if "num_blocks" in config:
        assert engine.stats().num_preemptions > 0, "the small pool preempted nothing: the case checks nothing"


def test_a_good_draft_takes_fewer_steps(models, every_draft):
    main, same, _ = models
    plain, fast = make_engine(main), drafting(main, same)
    outputs(plain, [PROMPTS[3]])
    outputs(fast, [PROMPTS[3]])
    assert fast.stats().num_steps < plain.stats().num_steps / 2


def test_seeded_sampled_requests_draw_plain_samplings_tokens(models, every_draft):
    main, same, other = models
    sampled = SamplingParams(temperature=0.05, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    plain = outputs(make_engine(main), sampling=sampled)
    checked = []
    for draft in (same, other):
        engine = drafting(main, draft)
        assert outputs(engine, sampling=sampled) == plain
        checked.append((engine.speculator.accepted, engine.speculator.proposed))
    (same_accepted, same_proposed), (other_accepted, other_proposed) = checked
    assert same_accepted > 0, "no sampled draft was accepted: the test checks nothing"
    assert other_accepted < other_proposed, "no draft was rejected: no random words handed back"


def test_stops_and_lengths_end_a_drafted_run_where_plain_decoding_ends_it(models, every_draft):
    main, same, other = models
    full = make_engine(main).generate([PROMPTS[0]], GREEDY)[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    for sampling in (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                     SamplingParams(temperature=0, max_tokens=40, stop=(stop,), ignore_eos=True)):
        plain = outputs(make_engine(main), [PROMPTS[0]], sampling)
        for draft in (same, other):
            assert outputs(drafting(main, draft, num_speculative_tokens=8), [PROMPTS[0]], sampling) == plain


def test_aborted_and_preempted_sequences_give_their_draft_blocks_back(models, every_draft):
    main, same, _ = models
    engine = drafting(main, same, num_blocks=40)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    start_free = engine.drafter.pool.num_blocks
    aborted = False
    while engine.has_unfinished:
        engine.step()
        running = set(map(id, engine.scheduler.running))
        assert all(id(seq) in running for seq in engine.drafter.mirrors), "a mirror of a sequence not running"
        held = sum(len(m.seq.block_table) for m in engine.drafter.mirrors.values())
        assert engine.drafter.pool.counts().free == start_free - held
        if not aborted and engine.drafter.mirrors and engine.stats().num_steps > 10:
            victim = next(iter(engine.drafter.mirrors)).request_id
            engine.abort(victim)
            aborted = True
            assert all(seq.request_id != victim for seq in engine.drafter.mirrors)
    assert aborted, "no mirror existed to abort"
    assert engine.stats().num_preemptions > 0
    assert_no_draft_blocks(engine)


def test_the_draft_pool_comes_out_of_the_same_budget(models):
    main, same, _ = models
    budget_gib = 0.002
    alone = make_engine(main, num_blocks=None, kv_budget_gib=budget_gib)
    engine = drafting(main, same, num_blocks=None, kv_budget_gib=budget_gib)
    per_block = engine.kv_bytes_per_block + engine.drafter.kv_bytes_per_block
    assert engine.drafter.pool.num_blocks == engine.pool.num_blocks
    assert engine.pool.num_blocks == int(budget_gib * (1 << 30)) // per_block
    assert engine.pool.num_blocks < alone.pool.num_blocks
    stats = engine.stats()
    assert stats.spec_method == "draft" and alone.stats().spec_method == "off"
    checked = replace(stats, spec_drafts=4, spec_accepted=2, spec_passes=2, spec_tokens=4)
    assert "speculation (draft) accepted 50% of 4 drafts" in speculation_summary(checked)
    assert checked.to_dict()["spec_method"] == "draft"  # --json's stats
    # The start-up line names the draft model and its share: its pool has as many blocks, from the same budget.
    assert stats.draft_kv_bytes == engine.pool.num_blocks * engine.drafter.kv_bytes_per_block > 0
    assert stats.draft_weights_bytes == engine.drafter.engine.weights_bytes > 0
    line = load_summary(stats)
    assert f"draft model {engine.drafter.name}: weights" in line and "from the same KV budget" in line
    assert "draft model" not in load_summary(alone.stats()) and alone.stats().draft_kv_bytes == 0


def test_draft_and_draft_model_come_together():
    with pytest.raises(PagecliError, match="--draft-model"):
        EngineConfig(speculate="draft")
    with pytest.raises(PagecliError, match="--speculate draft"):
        EngineConfig(draft_model="some/model")
    assert EngineConfig(speculate="draft", draft_model="some/model").draft_model == "some/model"
    assert EngineConfig().speculate == "auto"  # auto never picks a draft model


def test_a_draft_model_with_another_tokenizer_is_refused(models, tmp_path):
    main, _, other = models
    changed = tmp_path / "other-tokenizer"
    shutil.copytree(other, changed)
    tokenizer = json.loads((changed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]  # swap two merged tokens' ids: the same size, other meanings
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (changed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PagecliError, match="does not have the tokenizer") as refused:
        drafting(main, changed)
    assert changed.name in str(refused.value) and main.name in str(refused.value)


def test_a_slow_draft_model_is_only_probed(models, monkeypatch):
    """A draft step that costs as much as several main steps never pays: the sequence takes only the probes'
    passes, whose interval doubles; the output is plain decoding's."""
    from pagecli.engine import speculation

    main, same, _ = models
    sampling = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = outputs(make_engine(main), [PROMPTS[1]], sampling)
    monkeypatch.setattr(speculation, "draft_step_share", lambda seconds, plain_s: 5.0)
    engine = drafting(main, same)
    assert outputs(engine, [PROMPTS[1]], sampling) == plain
    spec = engine.speculator
    assert 2 <= spec.passes <= 4, spec.passes  # probes after 3, 17 more, 33 more steps (fewer with accepted drafts)
    assert spec.proposed == PROBE_DRAFTS * spec.passes


def test_the_draft_models_steps_count_in_the_budget():
    assert draft_step_share(None, 0.01) == draft_step_share(0.002, None) > 0  # the prior until both are timed
    assert abs(draft_step_share(0.002, 0.01) - 0.2) < 1e-12
    budget = DraftBudget()
    for _ in range(10):
        budget.after_pass(4, 4)  # a draft the main model always agrees with
    assert budget.length(0.2, 4) == 4  # drafts nearly free: all of them
    assert budget.length(0.2 + 1.0, 4) == 0  # each draft costs a whole main step more: none pay
    cost = RowCost(0.45, measure=True)
    assert cost.plain_step_s is None
    cost.observe(1, 0.01)
    assert cost.plain_step_s == 0.01
    clock = ProbeClock()
    due = [step for step in range(300) if clock.probe_due()]
    gaps = [b - a for a, b in zip(due, due[1:])]
    assert due[0] == 2 and gaps[:3] == [17, 33, 65] and max(gaps) == MAX_PROBE_EVERY + 1
    clock.drafting()
    assert [clock.probe_due() for _ in range(9)][-1]  # back to the short interval
