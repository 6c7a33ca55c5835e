"""The batched sampler (engine/sampler.py, native/sampling.cpp): every filter and combination draws from
exactly the filtered distribution (chi-square against tests/sampling_reference.py, 200,000 draws: a 1%
error in any probability fails), on the CPU kernel at every compiled level and on the tensor path; the
boundary cases; seeded draws that do not depend on the batch; penalties and the logit bias."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from native_levels import ops, skip_without_native  # noqa: F401 - ops: the fixture, once per compiled level
from pagecli.config import SamplingParams
from pagecli.engine.sampler import RandomStream, make_random, sample, skip_draw
from pagecli.engine.sampler_torch import round_uniforms, sample_rows_torch
from pagecli.engine.sequence import Sequence
from sampling_reference import reference_probs

DRAWS = 200_000
# Logits of a 12-token vocabulary with clear gaps (no filter's edge falls within rounding of a token).
LOGITS = [2.0, -1.0, 0.5, 3.1, -4.0, 1.2, 0.0, 2.6, -2.5, 1.7, -0.4, 0.9]
FILTERS = {
    "temperature": dict(temperature=0.7),
    "hot": dict(temperature=1.8),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=0.7, top_p=0.95),
    "top_p_small": dict(temperature=1.0, top_p=0.5),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "top_k_top_p": dict(temperature=0.9, top_k=6, top_p=0.8),
    "top_p_min_p": dict(temperature=0.7, top_p=0.9, min_p=0.05),
    "all": dict(temperature=1.3, top_k=8, top_p=0.9, min_p=0.02),
}


def draw_many(path, logits: list[float], params: SamplingParams, draws: int = DRAWS, seed: int = 0) -> list[int]:
    """`draws` tokens from one row of logits, each with its own random word (one row per draw)."""
    rng = random.Random(seed)
    words = [rng.getrandbits(64) for _ in range(draws)]
    rows = torch.tensor([logits], dtype=torch.float32).expand(draws, -1)
    if path == "torch":
        return sample_rows_torch(rows, [params] * draws, words)
    return path.sample_rows(rows, [params.temperature] * draws, [params.top_k] * draws, [params.top_p] * draws,
                            [params.min_p] * draws, words)


def chi_square_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square value a statistic of `dof` degrees of freedom passes with probability 1e-4 (z: the
    normal's 1e-4 quantile; Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_drawn_from(tokens: list[int], probs: list[float]) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    assert len(counts) == len(probs), "a token id past the vocabulary"
    for token, (count, p) in enumerate(zip(counts, probs)):
        if p == 0.0:
            assert count == 0, f"token {token} was dropped by a filter but drawn {count} times"
    kept = [(count, p * len(tokens)) for count, p in zip(counts, probs) if p > 0.0]
    if len(kept) == 1:
        return
    statistic = sum((count - expected) ** 2 / expected for count, expected in kept)
    assert statistic < chi_square_critical(len(kept) - 1), (statistic, counts, probs)


@pytest.fixture(params=["kernel", "torch"])
def path(request, ops):
    return ops if request.param == "kernel" else "torch"


@pytest.mark.parametrize("name", FILTERS)
def test_each_filter_draws_exactly_the_filtered_distribution(path, name):
    params = SamplingParams(**FILTERS[name])
    assert_drawn_from(draw_many(path, LOGITS, params), reference_probs(LOGITS, params))


def test_a_one_percent_error_in_a_probability_is_caught():
    """The test's power: draws from a distribution with one probability moved by 0.01 fail the check."""
    params = SamplingParams(temperature=1.0)
    probs = reference_probs(LOGITS, params)
    wrong = list(probs)
    wrong[0] += 0.01
    wrong[3] -= 0.01
    draws = torch.multinomial(torch.tensor(wrong), DRAWS, replacement=True, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError):
        assert_drawn_from(draws.tolist(), probs)


def test_a_large_vocabulary_flat_or_peaked_is_drawn_from_its_kept_tokens_only(path):
    """49,152 tokens, as SmolLM2's: top-p keeps most of a flat row (a random model's) and a few of a
    peaked one; every drawn token must be one the reference keeps, and the drawn mass must match it."""
    gen = torch.Generator().manual_seed(3)
    for scale in (0.3, 3.0, 12.0):
        logits = (torch.randn(49152, generator=gen) * scale).tolist()
        params = SamplingParams(temperature=0.7, top_p=0.95)
        probs = reference_probs(logits, params)
        tokens = draw_many(path, logits, params, draws=40 if path == "torch" else 300, seed=int(scale))
        assert all(probs[t] > 0 for t in tokens)


def test_top_p_keeping_exactly_one_token_always_draws_it(path):
    logits = [0.0, 5.0, 1.0, 2.0]  # token 1 holds 93% at temperature 1
    assert set(draw_many(path, logits, SamplingParams(temperature=1.0, top_p=0.9), draws=5000)) == {1}


def test_tokens_tied_at_a_threshold_are_all_kept(path):
    logits = [3.0, 1.0, 2.0, 2.0, 2.0, 0.0]  # three tokens tie for second place
    for params in (SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)):
        probs = reference_probs(logits, params)
        assert [p > 0 for p in probs] == [True, False, True, True, True, False]
        assert_drawn_from(draw_many(path, logits, params, draws=50_000), probs)


def test_min_p_above_every_probability_but_the_top_keeps_the_top(path):
    logits = [1.0, 0.0, 4.0, 3.9, -2.0]
    assert set(draw_many(path, logits, SamplingParams(temperature=1.0, min_p=0.95), draws=5000)) == {2}


def test_minus_infinity_and_nan_logits_are_never_drawn(path):
    logits = [float("-inf"), 1.0, float("nan"), 1.0, float("-inf")]
    assert set(draw_many(path, logits, SamplingParams(temperature=1.0, top_p=0.99), draws=5000)) == {1, 3}


def test_a_mask_that_leaves_one_token_draws_it_and_one_that_leaves_none_draws_nothing(path):
    one = [float("-inf")] * 40
    one[17] = -3.0
    assert set(draw_many(path, one, SamplingParams(temperature=0.7, top_p=0.95), draws=500)) == {17}
    none = [float("-inf")] * 40
    assert set(draw_many(path, none, SamplingParams(temperature=0.7, top_p=0.95), draws=10)) == {-1}


def test_plus_infinity_tokens_share_all_the_probability(path):
    logits = [0.0, float("inf"), 5.0, float("inf")]
    assert_drawn_from(draw_many(path, logits, SamplingParams(temperature=1.0), draws=20_000), [0, 0.5, 0, 0.5])


def test_the_kernel_reads_bfloat16_and_float16_logits_as_their_values(ops):
    params = SamplingParams(temperature=0.7, top_p=0.9)
    logits = torch.tensor([LOGITS]).expand(64, -1)
    rng = random.Random(5)
    words = [rng.getrandbits(64) for _ in range(64)]
    args = ([0.7] * 64, [0] * 64, [0.9] * 64, [0.0] * 64, words)
    exact = ops.sample_rows(logits.float(), *args)
    assert ops.sample_rows(logits.bfloat16(), *args) == ops.sample_rows(logits.bfloat16().float(), *args)
    assert ops.sample_rows(logits.half(), *args) == exact  # these logits are exact in float16
    assert all(reference_probs(LOGITS, params)[t] > 0 for t in exact)


def kernel_uniform(word: int, round_: int) -> float:
    """native/sampling.cpp's `uniform(random, round)`, written out: splitmix64 of the word moved by round
    golden ratios (the word itself for round 0), its top 53 bits."""
    mask = (1 << 64) - 1
    z = (word + round_ * 0x9E3779B97F4A7C15) & mask
    if round_:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
    return (z >> 11) * 2.0**-53


def test_the_tensor_paths_uniform_numbers_are_the_kernels():
    rng = random.Random(11)
    words = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(200))]
    expected = [[kernel_uniform(w, r) for r in range(5)] for w in words]
    assert round_uniforms(words, 5, torch.device("cpu")).tolist() == expected


@pytest.mark.parametrize("name", FILTERS)
def test_the_tensor_path_draws_the_kernels_token_from_the_same_word(ops, name):
    """A seeded request samples the same ids on a GPU (the tensor path) as on the CPU kernel: peaked,
    middling and flat rows (where top-p's rejection runs out of rounds), masked tails, one word each."""
    params = SamplingParams(**FILTERS[name])
    gen = torch.Generator().manual_seed(3)
    rows = 192
    logits = torch.randn(rows, 3000, generator=gen) * torch.tensor([0.3, 3.0, 12.0]).repeat(rows // 3)[:, None]
    logits[::7, 1500:] = float("-inf")
    rng = random.Random(name)
    words = [rng.getrandbits(64) for _ in range(rows)]
    kernel = ops.sample_rows(logits, [params.temperature] * rows, [params.top_k] * rows, [params.top_p] * rows,
                             [params.min_p] * rows, words)
    assert sample_rows_torch(logits, [params] * rows, words) == kernel


def sequences(params: list[SamplingParams]) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", [1, 2, 3], p, 64)
        seq.rng = make_random(p)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "torch"])
def test_a_seeded_request_draws_the_same_tokens_alone_or_in_a_batch(ops, with_kernel):
    kernels = ops if with_kernel else None
    gen = torch.Generator().manual_seed(9)
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in [(0, 0, 1), (1.0, 5, 1), (0.5, 0, 0.7)]]
    logits = [torch.randn(4, 500, generator=gen) * 3 for _ in range(20)]
    alone, batched = sequences([mine]), sequences([others[0], mine, *others[1:]])
    tokens_alone = [sample(step[1:2], alone, kernels)[0] for step in logits]
    tokens_batched = [sample(step, batched, kernels)[1] for step in logits]
    assert tokens_alone == tokens_batched


def test_the_device_path_samples_the_kernels_ids_for_every_sampling_field(ops):
    """sample() without the CPU kernels (a GPU's path: tensor operations, one copy to the host) gives the
    ids the kernels give for the same logits and seeds, step after step, over every field at once."""
    fields = [dict(temperature=0), dict(temperature=0.7, top_p=0.95), dict(temperature=1.1, top_k=20),
              dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02), dict(temperature=1.0, min_p=0.1),
              dict(temperature=0.8, top_p=0.3), dict(temperature=0.7, repetition_penalty=1.3),
              dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.4),
              dict(temperature=0.6, logit_bias={5: 4.0, 9: -100.0})]
    params = [SamplingParams(seed=100 + i, **f) for i, f in enumerate(fields)]
    gen = torch.Generator().manual_seed(4)
    on_kernel, on_device = sequences(params), sequences(params)
    for step in range(12):
        logits = torch.randn(len(params), 700, generator=gen) * (0.5 + step % 3 * 4)
        chosen = sample(logits, on_kernel, ops)
        assert chosen == sample(logits, on_device, None), step
        for a, b, token in zip(on_kernel, on_device, chosen):  # the penalties see the tokens drawn so far
            a.token_ids.append(token)
            b.token_ids.append(token)


def test_skipping_a_draw_moves_the_stream_as_a_draw_does():
    drawn, skipped = RandomStream(7), RandomStream(7)
    drawn.next_word()
    skip_draw(SimpleNamespace(rng=skipped))
    assert [drawn.next_word() for _ in range(20)] == [skipped.next_word() for _ in range(20)]


def test_the_seeds_of_a_requests_candidates_follow_one_another():
    params = SamplingParams(temperature=1.0, seed=40, n=3)
    assert make_random(params, 2).next_word() == RandomStream(42).next_word()
    assert make_random(SamplingParams(temperature=0)) is None


def test_presence_and_frequency_penalties_lower_generated_tokens_only():
    params = SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5)
    seq = sequences([params])[0]
    seq.token_ids = [1, 2, 3, 6, 6, 7]  # the prompt is [1, 2, 3]
    logits = torch.zeros(1, 10)
    logits[0, 6] = 2.9  # 2.9 - (1 + 2 * 0.5) = 0.9 < 1.0: token 3 wins over it
    logits[0, 3] = 1.0  # a prompt token: not penalised
    logits[0, 7] = 2.4  # 2.4 - 1.5 = 0.9
    assert sample(logits, [seq]) == [3]
    logits[0, 6] = 3.1  # 3.1 - 2 = 1.1: wins
    assert sample(logits, [seq]) == [6]


def test_logit_bias_moves_the_named_tokens():
    seq = sequences([SamplingParams(temperature=0.7, top_p=0.9, logit_bias={"4": 100, 2: -100})])[0]
    logits = torch.zeros(1, 8)
    logits[0, 2] = 50.0
    assert {sample(logits, [seq])[0] for _ in range(50)} == {4}


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logit_bias={"x": 1}),
                                 dict(logit_bias={"3": 101}), dict(logit_bias={"-1": 1}),
                                 dict(logit_bias={"3": True})])
def test_penalties_and_biases_out_of_range_are_refused(bad):
    from pagecli.errors import PagecliError

    with pytest.raises(PagecliError, match="must"):
        SamplingParams(**bad)


def test_a_batch_line_takes_penalties_and_bias_and_refuses_echo_and_suffix():
    from pagecli.batch.requests import BadLine, parse_json_line, sampling_with

    line = parse_json_line('{"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -0.5, '
                           '"logit_bias": {"7": -100}}', 1)
    sampling = sampling_with(SamplingParams(), line.sampling)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias) == (0.5, -0.5, ((7, -100.0),))
    for field in ('"echo": true', '"suffix": "x"'):
        bad = parse_json_line('{"prompt": "hi", ' + field + '}', 2)
        assert isinstance(bad, BadLine) and field.split(":")[0].strip('"') in bad.error


def test_a_logit_bias_past_the_vocabulary_fails_its_request_alone(tiny_llama):
    from pagecli.config import EngineConfig
    from pagecli.engine import Engine
    from pagecli.errors import RequestError

    engine = Engine(str(tiny_llama), EngineConfig(num_blocks=32))
    vocab = engine.loaded.spec.vocab_size
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add_request("Hello", SamplingParams(logit_bias={vocab: 5.0}))
    [done] = engine.generate(["Hello"], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4,
                                                       logit_bias={vocab - 1: 100.0}, ignore_eos=True))
    assert set(done.token_ids) == {vocab - 1}
