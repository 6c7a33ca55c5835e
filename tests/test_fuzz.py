"""Fuzzing (hypothesis): the input parsers never fail in an unplanned way, and the scheduler, under
random arrivals, lengths, stop strings and cancellations on a tiny pool, keeps every pool invariant
and gives each request the output it gets alone.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from pool_checks import check_engine_pool

from pagecli.chat.commands import COMMANDS, Command, apply_settings, parse_line
from pagecli.batch.requests import SAMPLING_KEYS, BadLine, BatchRequest, parse_json_line
from pagecli.batch.submit import line_sampling
from pagecli.config import EngineConfig, SamplingParams
from pagecli.config.profiles import parse_profile
from pagecli.engine import Engine
from pagecli.engine.sampler import make_random, sample
from pagecli.engine.sampler_torch import kept_weights
from pagecli.engine.sequence import Sequence
from pagecli.errors import PagecliError
from pagecli.models.loader import load_model


@pytest.fixture(autouse=True, scope="module")
def keep_torch_threads():
    """Engines here run on one thread (a tiny model: more threads only contend); put the setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# --- the batch line parser ---------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system"]) | json_values,
                                              "content": st.text(max_size=20) | json_values})
request_keys = st.sampled_from(["prompt", "messages", "id", "custom_id", "body", "max_completion_tokens", "model",
                                *SAMPLING_KEYS])
request_values = (json_values | st.text(max_size=20) | st.lists(message, max_size=3)
                  | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70))
request_objects = st.dictionaries(request_keys, request_values, max_size=6)
sampling_fields = st.dictionaries(st.sampled_from(SAMPLING_KEYS),
                                  json_scalars | st.integers(2**62, 2**66).map(lambda n: n * (-1) ** n), max_size=4)
lines = (st.text(max_size=60)
         | sampling_fields.map(lambda fields: json.dumps({"prompt": "Hello", **fields}))
         | json_values.map(json.dumps)
         | request_objects.map(json.dumps)
         | st.builds(lambda body, cid: json.dumps({"custom_id": cid, "body": body}), request_objects, json_values))


@settings(max_examples=400, deadline=None)
@given(lines, st.integers(1, 10**6))
def test_a_batch_line_parses_to_a_request_or_a_bad_line_naming_its_number(raw, number):
    parsed = parse_json_line(raw, number)
    assert isinstance(parsed, (BatchRequest, BadLine)) and parsed.line == number
    assert isinstance(parsed.request_id, str)
    if isinstance(parsed, BadLine):
        assert parsed.error.startswith(f"line {number}: ")
        return
    if isinstance(parsed.prompt, str):
        assert parsed.prompt.strip()
    else:
        assert parsed.prompt and all(isinstance(m["role"], str) and isinstance(m["content"], str)
                                     for m in parsed.prompt)
    assert set(parsed.sampling) <= set(SAMPLING_KEYS)
    try:  # the line's sampling fields: a SamplingParams the sampler can use, or an error naming the line
        sampling = line_sampling(SamplingParams(), parsed.sampling, number)
    except PagecliError as exc:
        assert str(exc).startswith(f"line {number}: ")
    else:
        make_random(sampling)


numbers = (st.integers() | st.integers(2**62, 2**66).map(lambda n: n * (-1) ** n)
           | st.floats() | st.floats(0, 1e-30) | st.booleans() | st.text(max_size=3) | st.none())
sampling_overrides = st.dictionaries(st.sampled_from(SAMPLING_KEYS), numbers, max_size=3)


@settings(max_examples=300, deadline=None)
@given(sampling_overrides, st.lists(st.floats(-1e4, 1e4), min_size=2, max_size=16))
@example({"seed": 2**64}, [0.0, 1.0])  # past 64 bits: torch.Generator.manual_seed overflowed mid-run
@example({"temperature": 1e-40}, [1.0, 2.0])  # logits / temperature overflowed: NaN probabilities
@example({"temperature": 1e-3, "repetition_penalty": 1e-40}, [1.0, 2.0])
@example({"top_p": 1e-218}, [0.0, 0.0])  # top_p rounded to 0 in float32 dropped every token
def test_per_line_sampling_values_are_refused_with_the_line_number_or_sample_finite_probabilities(
        fields, logits):
    import torch

    try:
        sampling = line_sampling(SamplingParams(), fields, 7)
    except PagecliError as exc:
        assert str(exc).startswith("line 7: ")
        return
    seq = Sequence("fuzzed", [0, 1], sampling, 64)  # tokens 0 and 1 seen: the repetition penalty applies
    seq.rng = make_random(sampling)
    [token] = sample(torch.tensor([logits]), [seq])
    assert 0 <= token < len(logits)
    if not sampling.greedy:
        weights = kept_weights(torch.tensor([logits]), [sampling])
        assert torch.isfinite(weights).all() and float(weights.sum()) > 0


# --- profiles -----------------------------------------------------------------------------------------------
engine_keys = st.sampled_from(["block_size", "kv_budget_gib", "num_blocks", "max_num_seqs", "dtype", "attention",
                               "enable_prefix_caching", "threads", "disk_cache_dir", "max_model_len", "bogus"])
sampling_keys = st.sampled_from([*SAMPLING_KEYS, "ignore_eos", "bogus"])
toml_scalars = st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
toml_values = toml_scalars | st.lists(toml_scalars, max_size=3) | st.dictionaries(st.text(max_size=4), toml_scalars,
                                                                                  max_size=2)
profiles = st.fixed_dictionaries({}, optional={
    "model": toml_values, "description": toml_values,
    "engine": st.dictionaries(engine_keys, toml_values, max_size=4) | toml_scalars,
    "sampling": st.dictionaries(sampling_keys, toml_values, max_size=4) | toml_scalars,
    "extra": toml_values,
})


@settings(max_examples=300, deadline=None)
@given(profiles)
def test_a_profile_either_loads_into_valid_settings_or_raises_one_pagecli_error_naming_the_file(data):
    path = Path("/profiles/fuzzed.toml")
    try:
        profile = parse_profile(data, path)
    except PagecliError as exc:
        assert "fuzzed.toml" in str(exc)
        return
    assert isinstance(profile.engine_config(), EngineConfig)
    make_random(profile.sampling_params())


# --- slash commands -----------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40) | st.builds("/{}{}".format, st.sampled_from([*COMMANDS, "quit", "q", "?", "se"]),
                                       st.text(max_size=30)))
def test_a_chat_line_is_a_message_or_a_command_and_set_arguments_fail_only_with_a_sentence(line):
    parsed = parse_line(line)
    if isinstance(parsed, str):
        assert not line.strip().startswith("/") or line.strip().startswith("//")
        return
    assert isinstance(parsed, Command) and parsed.known == (parsed.name in COMMANDS)
    if parsed.name == "set":
        try:
            make_random(apply_settings(SamplingParams(), parsed.argument))
        except PagecliError as exc:
            assert str(exc).strip()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
                                           "repetition_penalty", "Top-P", "nope"]),
                          st.text(string.digits + ".-e", max_size=25) | st.sampled_from(["inf", "nan", "none", ""])),
                min_size=1, max_size=4))
def test_set_with_numbers_of_any_shape_gives_valid_sampling_or_a_sentence(pairs):
    argument = " ".join(f"{key}={value}" for key, value in pairs)
    try:
        make_random(apply_settings(SamplingParams(), argument))
    except PagecliError as exc:
        assert str(exc).strip()


# --- the scheduler --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded_tiny(tiny_model_factory):
    return load_model(tiny_model_factory("llama"), "float32", "cpu", max_positions=512)


_alone: dict[tuple, tuple[tuple[int, ...], str, str]] = {}


def output_alone(loaded, prompt: tuple[int, ...], sampling: SamplingParams) -> tuple[tuple[int, ...], str, str]:
    """The request run by itself in a roomy pool: (token ids, text, finish reason), memoised."""
    key = (prompt, sampling)
    if key not in _alone:
        config = EngineConfig(device="cpu", attention="torch", num_blocks=64, disk_cache=False, threads=1)
        engine = Engine(config=config, loaded=loaded)
        [done] = engine.generate([list(prompt)], sampling)
        _alone[key] = (done.token_ids, done.text, done.finish_reason)
    return _alone[key]


fuzzed_request = st.fixed_dictionaries({
    "arrival_step": st.integers(0, 4),
    "prompt": st.lists(st.integers(3, 9), min_size=1, max_size=18).map(tuple),  # few ids: shared prefixes
    "max_tokens": st.integers(1, 6),
    "stop_at": st.none() | st.integers(0, 40),  # a stop string: the character at this place in the output alone
    "abort_step": st.integers(0, 30).map(lambda step: step if step <= 12 else None),  # about 2 in 5 cancelled
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(requests=st.lists(fuzzed_request, min_size=1, max_size=10), block_size=st.sampled_from([1, 2, 4]),
       extra_blocks=st.integers(0, 4), max_num_seqs=st.integers(1, 8), step_tokens=st.integers(1, 24),
       prefix_caching=st.booleans())
def test_random_arrivals_lengths_stops_and_cancellations_keep_the_pool_sound(
        loaded_tiny, requests, block_size, extra_blocks, max_num_seqs, step_tokens, prefix_caching):
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    num_blocks = -(-longest // block_size) + extra_blocks  # the longest request fits alone, barely or easily
    engine = Engine(config=EngineConfig(device="cpu", attention="torch", block_size=block_size, num_blocks=num_blocks,
                                        max_num_seqs=max_num_seqs, max_num_batched_tokens=step_tokens,
                                        enable_prefix_caching=prefix_caching, disk_cache=False, threads=1),
                    loaded=loaded_tiny)
    for r in requests:
        r["sampling"] = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        text = output_alone(loaded_tiny, r["prompt"], r["sampling"])[1]
        if r["stop_at"] is not None and text.strip():
            stop = text[r["stop_at"] % len(text)]
            r["sampling"] = SamplingParams(temperature=0, max_tokens=r["max_tokens"], stop=(stop,), ignore_eos=True)
    ids: dict[str, dict] = {}
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    step = 0
    while step <= 8 or engine.has_unfinished:
        for r in requests:
            if r["arrival_step"] == step:
                request_id = engine.add_request(list(r["prompt"]), r["sampling"])
                ids[request_id], tokens[request_id] = r, []
        for request_id, r in ids.items():
            if r["abort_step"] == step and request_id not in finished and request_id not in aborted:
                engine.abort(request_id)
                aborted.add(request_id)
        if engine.has_unfinished:
            for output in engine.step():
                assert output.request_id not in aborted and output.request_id not in finished
                tokens[output.request_id].extend(output.token_ids)
                if output.finished:
                    finished[output.request_id] = output.finish_reason
        check_engine_pool(engine)
        step += 1
        assert step < 2000, "no progress"
    assert set(finished) | aborted == set(ids) and not set(finished) & aborted
    for request_id in finished:
        r = ids[request_id]
        expected_ids, _, expected_reason = output_alone(loaded_tiny, r["prompt"], r["sampling"])
        assert (tuple(tokens[request_id]), finished[request_id]) == (expected_ids, expected_reason)
    assert engine.stats().blocks_active == 0
    event(f"preempted: {engine.stats().num_preemptions > 0}")  # --hypothesis-show-statistics shows the mix
    event(f"cancelled: {bool(aborted)}")
    event(f"stopped by a stop string: {any(reason == 'stop' for reason in finished.values())}")
