"""Constrained decoding in the engine: outputs follow their schema, regex or choice, and greedy output does not
depend on batching, chunked prefill, preemption or prefix hits (as tests/test_engine_invariance.py for plain
requests); requests without a grammar in the same batch are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.config.structured import StructuredSpec
from pagecli.engine import Engine
from pagecli.engine.structured import GrammarCompiler, apply_grammar_masks
from pagecli.errors import RequestError
from pagecli.models.loader import load_model

# Bounded on purpose: a random tiny model fills unbounded strings until max_tokens, and every gap between JSON
# tokens with the most whitespace the grammar allows (20 characters); this schema ends within 400 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "count", "colour"],
    "additionalProperties": False,
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks. " * 3,
    "Hello world! How are you today?",
    "Très bien, merci. 日本語のテキスト。",
    "def main():\n    print('hello')\n" * 2,
    "fox",
]
CONSTRAINED = SamplingParams(temperature=0, max_tokens=400, structured=StructuredSpec.json_schema(SCHEMA))
PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": 16, "num_blocks": 256,
                **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def run(engine: Engine, prompts=PROMPTS, sampling=CONSTRAINED) -> list[tuple[int, ...]]:
    outs = [o.token_ids for o in engine.generate(prompts, sampling)]
    assert engine.stats().blocks_active == 0, "a finished batch left active blocks"
    return outs


@pytest.fixture(scope="module")
def baseline(tiny_model_factory):
    """Each prompt alone under the schema: the reference every variant must equal."""
    engine = make_engine(tiny_model_factory("llama"))
    return [run(engine, [p])[0] for p in PROMPTS]


def test_every_constrained_output_parses_and_follows_the_schema(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    for out in engine.generate(PROMPTS, CONSTRAINED):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_the_grammar_changes_what_an_unconstrained_model_says(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"))
    plain = run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=400))
    assert plain != baseline  # a random model never writes this JSON by itself: the mask is doing it


def test_batched_constrained_requests_equal_each_alone(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), max_num_seqs=32)
    assert run(engine, PROMPTS * 3) == baseline * 3


def test_chunked_prefill_does_not_change_constrained_output(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), max_num_batched_tokens=5)
    assert run(engine) == baseline


def test_preemption_keeps_the_grammar_state(tiny_model_factory, baseline):
    # 128 blocks of 4 hold every sequence alone (max_model_len stays 512), not the six together.
    engine = make_engine(tiny_model_factory("llama"), block_size=4, num_blocks=128)
    assert run(engine) == baseline
    assert engine.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"


def test_prefix_hits_do_not_change_constrained_output(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"), block_size=4)
    assert run(engine) == baseline
    assert run(engine) == baseline
    assert engine.stats().prefix_hit_tokens > 0


def test_mixed_batch_constrained_and_plain_each_as_alone(tiny_model_factory, baseline):
    engine = make_engine(tiny_model_factory("llama"))
    plain_alone = [run(engine, [p], PLAIN)[0] for p in PROMPTS]
    ids = []
    for prompt in PROMPTS:
        ids.append(engine.add_request(prompt, CONSTRAINED))
        ids.append(engine.add_request(prompt, PLAIN))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for event in engine.stream():
        tokens[event.request_id].extend(event.token_ids)
    assert [tuple(tokens[i]) for i in ids[0::2]] == baseline
    assert [tuple(tokens[i]) for i in ids[1::2]] == plain_alone


def test_regex_and_choice_constraints_hold(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    regex = SamplingParams(temperature=0, max_tokens=40, structured=StructuredSpec("regex", r"[0-9]{3}-(yes|no)"))
    for out in engine.generate(PROMPTS, regex):
        assert re.fullmatch(r"[0-9]{3}-(yes|no)", out.text) and out.finish_reason == "stop", out
    options = ("alpha", "beta gamma", "δέλτα")
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=StructuredSpec.choice(options))
    assert {out.text for out in engine.generate(PROMPTS * 3, choice)} <= set(options)


def test_ebnf_and_structural_tag_constraints_hold(tiny_model_factory):
    import xgrammar

    engine = make_engine(tiny_model_factory("llama"))
    ebnf = StructuredSpec("ebnf", 'root ::= ("yes" | "no") " " [0-9] [0-9]?')
    for out in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, structured=ebnf)):
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", out.text), out
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2, 3]}}, "required": ["x"], "additionalProperties": False}}}
    tag = xgrammar.get_model_structural_tag("qwen_3", tools=[tool], tool_choice="required", reasoning=False,
                                            max_whitespace_cnt=2, parallel_tool_calls=False)
    calls = SamplingParams(temperature=0, max_tokens=300, structured=StructuredSpec("structural_tag",
                                                                                   tag.model_dump_json()))
    for out in engine.generate(PROMPTS[:3], calls):  # exactly one call, its arguments as the schema says
        call = re.fullmatch(r'<tool_call>\n\{"name": "f", "arguments": (.*)\}\n</tool_call>', out.text, re.S)
        assert out.finish_reason == "stop" and call, out
        assert json.loads(call.group(1))["x"] in (1, 2, 3)


def test_each_candidate_of_n_follows_the_schema(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    sampling = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=400, structured=CONSTRAINED.structured)
    outs = engine.generate(PROMPTS[:2], sampling)
    assert len(outs) == 8
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({out.text for out in outs}) > 1  # the candidates sample on their own


def test_json_object_gives_an_object_and_ends_even_with_ignore_eos(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"))
    sampling = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True,
                              structured=StructuredSpec.json_object())
    for out in engine.generate(PROMPTS[:3], sampling):
        if out.finish_reason == "stop":  # the grammar ended it, despite ignore_eos
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{") and out.completion_tokens == 300


@pytest.mark.parametrize("sampling", [
    CONSTRAINED,
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=400, structured=CONSTRAINED.structured),
], ids=["greedy", "seeded"])
def test_forced_tokens_skip_steps_alone_and_change_nothing(tiny_model_factory, monkeypatch, sampling):
    """A request running alone appends the tokens its grammar forces without steps; its output is the same."""
    from pagecli.engine.structured import GrammarState

    engine = make_engine(tiny_model_factory("llama"))
    fast = [engine.generate([p], sampling)[0].token_ids for p in PROMPTS]
    fast_steps = engine.stats().num_steps
    monkeypatch.setattr(GrammarState, "forced_token", lambda self: None)  # step-by-step: every token sampled
    slow_engine = make_engine(tiny_model_factory("llama"))
    slow = [slow_engine.generate([p], sampling)[0].token_ids for p in PROMPTS]
    assert fast == slow
    assert fast_steps < slow_engine.stats().num_steps  # the schema's fixed parts ("ok", "count", ...) took none


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grammar_masks_equal_xgrammars_own_on_some_or_all_rows(tiny_model_factory, dtype):
    import xgrammar

    engine = make_engine(tiny_model_factory("llama"))
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.spec.vocab_size, engine.stop_token_ids)
    states = [compiler.new_state(CONSTRAINED.structured) for _ in range(3)]
    for token in engine.tokenizer('{"ok": tr', add_special_tokens=False)["input_ids"]:
        assert states[1].accept(token)  # row 1 is inside the value, the others at the start
    for rows in ([0, 2], [0, 1, 2]):
        logits = torch.randn(3, engine.loaded.spec.vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
        expected = logits.float()
        bitmask = xgrammar.allocate_token_bitmask(3, logits.shape[1])
        for row in rows:
            states[row].matcher.fill_next_token_bitmask(bitmask, row)
        xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        apply_grammar_masks(logits, rows, [states[row] for row in rows])
        assert torch.equal(logits.float(), expected)
        assert 0 < int(torch.isinf(logits[rows[-1]]).logical_not().sum()) < logits.shape[1]


def test_a_greedy_row_whose_argmax_the_grammar_allows_is_not_masked(tiny_model_factory):
    """The greedy fast path: rows whose unmasked argmax is allowed keep their logits; the rest are masked as
    xgrammar masks them, and the sampler's choice equals the argmax of the fully masked logits."""
    import xgrammar

    from pagecli.engine.sampler import sample
    from pagecli.engine.sequence import Sequence

    engine = make_engine(tiny_model_factory("llama"))
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.spec.vocab_size, engine.stop_token_ids)
    states = [compiler.new_state(CONSTRAINED.structured) for _ in range(3)]
    vocab = engine.loaded.spec.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(3, vocab)
    for row, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, row)
    allowed = [t for t in range(vocab) if (int(bitmask[0, t >> 5]) >> (t & 31)) & 1]
    forbidden = next(t for t in range(vocab) if t not in allowed)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, allowed[-1]] = 50.0  # row 0: the argmax is allowed
    logits[1, forbidden] = 50.0  # row 1: the argmax is forbidden
    logits[2, allowed[0]] = 50.0  # row 2: allowed, but the row samples, so it is masked
    full = logits.clone()
    xgrammar.apply_token_bitmask_inplace(full, bitmask)
    before = logits.clone()
    masked = apply_grammar_masks(logits, [0, 1, 2], states, [allowed[-1], forbidden, None])
    assert masked == [1, 2]
    assert torch.equal(logits[0], before[0])
    assert torch.equal(logits[1:], full[1:])

    seqs = []
    penalised = SamplingParams(temperature=0, repetition_penalty=1.2, structured=CONSTRAINED.structured)
    for row, state in enumerate(states):
        seq = Sequence(str(row), [1], CONSTRAINED if row < 2 else penalised, max_model_len=64)
        seq.grammar = state
        seqs.append(seq)
    assert sample(before.clone(), seqs) == full.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("spec, message", [
    (StructuredSpec("json_schema", '{"type": "strin"}'), "Unsupported type"),
    (StructuredSpec("json_schema", '{"type": "array", "uniqueItems": true}'), "'uniqueItems' at #"),
    (StructuredSpec("json_schema", '{"type": "object", "properties": {"a": {"not": {}}}}'), "'not' at #/properties/a"),
    (StructuredSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "cannot be compiled"),
    (StructuredSpec("regex", "[a-z"), "Unclosed"),
    (StructuredSpec("ebnf", 'root ::= other'), "not defined"),
])
def test_an_invalid_constraint_is_the_requests_error_at_submission(tiny_model_factory, spec, message):
    engine = make_engine(tiny_model_factory("llama"))
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.add_request("fox", SamplingParams(structured=spec))
    assert not engine.has_unfinished
    assert engine.generate(["fox"], CONSTRAINED)[0].finish_reason == "stop"  # the engine goes on


def test_a_malformed_spec_is_refused_when_built():
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredSpec.json_schema("{nope")
    with pytest.raises(RequestError, match="non-empty list"):
        StructuredSpec.choice([])
    with pytest.raises(RequestError, match="kind must be one of"):
        StructuredSpec("xml", "x")  # type: ignore[arg-type]


@pytest.mark.slow
def test_smollm2_answers_follow_a_schema(smollm2_dir):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "country": {"type": "string", "maxLength": 24},
                                               "population_millions": {"type": "number"}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    engine = make_engine(smollm2_dir, num_blocks=512)
    sampling = SamplingParams(temperature=0, max_tokens=64, structured=StructuredSpec.json_schema(schema))
    prompts = [[{"role": "user", "content": f"Give {c}'s country and population as JSON."}]
               for c in ("Paris", "Tokyo", "Lagos", "Lima")]
    outs = engine.generate(prompts, sampling)
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.generate(prompts[:1], sampling)[0].token_ids == outs[0].token_ids  # alone as in the batch


@pytest.mark.parametrize("schema", [{"$ref": "#"},
                                    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"}])
def test_a_schema_that_admits_nothing_is_refused_before_its_request_runs(tiny_model_factory, schema):
    engine = make_engine(tiny_model_factory("llama"))
    # xgrammar 0.2.9 refuses such a $ref chain itself at compile time; older versions compile it and pagecli
    # finds the grammar admits nothing: either way one sentence, before the request runs.
    with pytest.raises(RequestError, match=r"admits no output|cannot be compiled: Circular \$ref chain"):
        engine.add_request("Hi", SamplingParams(structured=StructuredSpec.json_schema(schema)))
    assert not engine.has_unfinished


@pytest.mark.parametrize("temperature", [0.7, 0.0], ids=["sampled", "greedy"])
def test_a_grammar_that_leaves_no_token_ends_its_request_alone(tiny_model_factory, monkeypatch, temperature):
    """Whatever a grammar does mid-run, a mask that allows nothing ends that request (finish_reason "error"),
    and the request beside it gets the tokens it gets alone."""
    from pagecli.engine import structured

    folder = tiny_model_factory("llama")
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = make_engine(folder).generate(["Hello there"], plain)[0]

    def mask_everything(logits, rows, states, greedy_choices=None):
        with torch.inference_mode():  # the step's logits are inference tensors
            logits[rows] = float("-inf")
        return list(rows)

    monkeypatch.setattr(structured, "apply_grammar_masks", mask_everything)
    engine = make_engine(folder)
    dead = engine.add_request("Hi", SamplingParams(temperature=temperature, max_tokens=12,
                                                   structured=StructuredSpec.json_object()))
    live = engine.add_request("Hello there", plain)
    events = list(engine.stream())
    ended = [e for e in events if e.request_id == dead]
    assert [e.finish_reason for e in ended] == ["error"] and ended[0].token_ids == ()
    tokens = [t for e in events if e.request_id == live for t in e.token_ids]
    assert tuple(tokens) == alone.token_ids
