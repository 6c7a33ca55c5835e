"""Mixtral, Qwen3-MoE and OLMoE equal transformers on the same weights: logits after prefill and each decode
step within LOGIT_ATOL, and greedy tokens token-for-token, in float32, on the compiled CPU kernels of every
level this machine runs and on the PyTorch path (PAGECLI_CPU_ISA=torch). A decode token runs only its chosen
experts, each chosen expert runs once per step on its group of tokens, experts quantize to int8 and int4 (the
router stays in floats), and paging, chunked prefill, preemption and prefix hits never change the output.

The tiny models (tests/tiny_models.py) have 8 experts, 2 per token, and weights scaled so the logits and the
router's choices spread (std about 1): Mixtral renormalises the two picked probabilities, Qwen3-MoE by its
norm_topk_prob and with a dense MLP on one layer (mlp_only_layers), OLMoE neither, with q/k norms over the
whole projection.
"""

from __future__ import annotations

import json

import pytest
import torch

from architecture_helpers import LEVELS, at_level, engine_for, transformers_model  # noqa: F401 - at_level: a fixture
from engine_probes import recorded_logits
from native_levels import COMPILED_LEVELS
from pagecli.config import SamplingParams
from pagecli.errors import ModelError
from pagecli.models.layers import GatedMLP
from pagecli.models.loader import load_model
from pagecli.models.moe import SparseMoE
from tiny_models import MOE_ARCHS

LOGIT_ATOL = 1e-4
DECODE_STEPS = 12
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention keeps"
TEXT = ("The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size blocks. "
        "Hello world! How are you today? def main():\n    print('hello')\n")
GREEDY = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_logits_match_transformers_after_prefill_and_each_decode(arch, level, at_level, tiny_model_factory):
    at_level(level)
    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    assert engine.plan.decode_step == (level != "torch")  # the one-call native decode step runs the experts
    logits = recorded_logits(engine)
    [out] = engine.generate([PROMPT], GREEDY)
    prompt_ids = engine.encode(PROMPT)
    with torch.no_grad():
        ref = transformers_model(folder)(torch.tensor([prompt_ids + list(out.token_ids)])).logits[0]
    assert ref.std() > 0.5, "the logits are meant to spread"
    assert len(logits) == DECODE_STEPS
    for step, got in enumerate(logits):
        diff = (got[0] - ref[len(prompt_ids) - 1 + step]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch} at {level}: step {step} logits differ by {diff}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, level, at_level, tiny_model_factory):
    at_level(level)
    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    prompts = ["Hello world! How are you", "Très bien, merci. 日本語", "def main():\n    print("]
    outs = engine.generate(prompts, GREEDY)  # one batch: the three prompts' tokens share each expert's group
    hf = transformers_model(folder)
    hf.generation_config.eos_token_id = None  # ignore_eos on both sides
    for prompt, out in zip(prompts, outs):
        ids = engine.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                          pad_token_id=0)[0][len(ids):]
        assert list(out.token_ids) == ref.tolist(), f"{arch} at {level}: {prompt!r}"


def _count_expert_calls(model) -> list[list[int]]:
    """Per MoE layer, how many rows each call of an expert had (wrapping every expert's forward)."""
    calls: list[list[int]] = []
    for layer in model.model.layers:
        if not isinstance(layer.mlp, SparseMoE):
            continue
        seen: list[int] = []
        calls.append(seen)
        for expert in layer.mlp.experts:
            def counting(x, run=expert.forward, seen=seen):
                seen.append(x.shape[0])
                return run(x)

            expert.forward = counting
    return calls


def test_a_decode_token_runs_only_its_chosen_experts_once_each(tiny_model_factory):
    """A prefill of n tokens runs each chosen expert once, on its whole group (the groups' rows add up to
    n * top_k); then each decode step runs exactly top_k experts (2 of 8) per MoE layer, on one row each."""
    engine = engine_for(tiny_model_factory("olmoe"), enable_prefix_caching=False)
    # Counted in the Python layer loop; the one-call decode step's experts (moe_experts.h) run the same
    # routing and grouping, bit for bit (tests/test_native_ops.py).
    engine.loaded.model.decode_step = None
    calls = _count_expert_calls(engine.loaded.model)
    prompt_ids = engine.encode(PROMPT)
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for seen in calls:
        prefill, decode = seen[:-4], seen[-4:]
        assert sum(prefill) == 2 * len(prompt_ids) and len(prefill) <= 8
        assert decode == [1, 1, 1, 1]  # two decode steps, two experts each


def test_a_lone_token_gets_what_it_gets_in_a_batch(tiny_model_factory):
    """The one-token path (a decode step of one sequence) and the grouped path give each row the same output,
    and both equal a dense reference that runs every expert on every token and weights all but the top k by 0."""
    model = load_model(tiny_model_factory("mixtral"), "float32", "cpu", max_positions=64).model
    moe = model.model.layers[0].mlp
    x = torch.randn(7, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batch = moe(x)
        alone = torch.cat([moe(x[i:i + 1]) for i in range(7)])
        weights, chosen = moe.route(x)
        dense = torch.zeros(7, len(moe.experts)).scatter_(1, chosen, weights)  # [tokens, experts]
        expected = sum(dense[:, e:e + 1] * expert(x) for e, expert in enumerate(moe.experts))
    torch.testing.assert_close(alone, batch, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batch, expected, rtol=1e-5, atol=1e-5)


def _next_token_logits(folder, prompts, **config) -> torch.Tensor:
    """The logits each prompt gives for its next token [len(prompts), vocab] (one step, no decoding)."""
    engine = engine_for(folder, **config)
    logits = recorded_logits(engine)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return torch.cat(logits)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_quantize_and_the_router_keeps_its_floats(arch, quantize, tiny_model_factory):
    """Under --quantize int8/int4 every expert's products are quantized and the router is not (on the compiled
    levels it runs on the float panels, as a float32 model's float products do). Against the float
    model, on the next token after each of 18 prefixes of a text: int8 picks the same token on at least 90% and
    its logits differ by under 10% (relative norm; measured: 94-100% and 2-8%); int4's differ by under 60%
    (measured 31-48%, the same token on 39-61%: at these tiny models' weight scale, std 0.15, Phi-3's int4
    logits differ by 45% too, and a changed hidden state can change the router's picks)."""
    folder = tiny_model_factory(arch)
    quantized = engine_for(folder, quantize=quantize)
    for layer in quantized.loaded.model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            gate = layer.mlp.gate  # float32, as loaded or on the float panels (the same values; row-invariant sums)
            assert (gate.weight is not None and gate.weight.dtype == torch.float32) or \
                type(gate.packed).__name__ == "F32PanelLinear", gate.packed
            for expert in layer.mlp.experts:
                assert expert.gate_up_proj.weight is None and expert.down_proj.weight is None
        else:
            assert isinstance(layer.mlp, GatedMLP) and layer.mlp.gate_up_proj.weight is None
    ids = quantized.encode(TEXT)
    prompts = [ids[:n] for n in range(4, len(ids), 3)]
    floats = _next_token_logits(folder, prompts)
    rounded = _next_token_logits(folder, prompts, quantize=quantize)
    same = (floats.argmax(-1) == rounded.argmax(-1)).float().mean().item()
    relative = ((floats - rounded).norm(dim=-1) / floats.norm(dim=-1)).mean().item()
    if quantize == "int8":
        assert same >= 0.9 and relative < 0.1, (same, relative)
    else:
        assert relative < 0.6, relative


@pytest.mark.skipif(not COMPILED_LEVELS, reason="no compiled CPU level on this machine")
@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_native_quantized_experts_give_the_pytorch_references_tokens(arch, quantize, at_level, tiny_model_factory):
    """The same quantized experts on the compiled kernels (grouped rows: 1 to a prompt's length) and on the
    PyTorch reference of their arithmetic: the same greedy tokens."""
    folder = tiny_model_factory(arch)
    prompts = ["Hello world! How are you", PROMPT]
    tokens = {}
    for level in ("torch", COMPILED_LEVELS[-1]):
        at_level(level)
        tokens[level] = [o.token_ids for o in engine_for(folder, quantize=quantize).generate(prompts, GREEDY)]
    assert tokens["torch"] == tokens[COMPILED_LEVELS[-1]]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_paging_chunking_preemption_and_prefix_hits_never_change_the_output(arch, tiny_model_factory):
    """Each prompt alone is the reference; together in one batch (other groups per expert), prefilled in chunks
    of 5 tokens, in a pool small enough to preempt, and after a shared prefix was cached: the same tokens."""
    folder = tiny_model_factory(arch)
    head = "Paged attention keeps the KV cache in fixed-size blocks. "
    prompts = [head + "The quick brown fox", head + "Hello world!", "def main():\n    print('hello')\n", "fox"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [engine_for(folder, enable_prefix_caching=False).generate([p], greedy)[0].token_ids for p in prompts]
    engine = engine_for(folder)
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == alone
    assert [o.token_ids for o in engine.generate(prompts, greedy)] == alone  # every prompt a prefix hit now
    assert engine.stats().prefix_hit_tokens > 0
    chunked = engine_for(folder, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked.generate(prompts, greedy)] == alone
    small = engine_for(folder, num_blocks=14, enable_prefix_caching=False)
    assert [o.token_ids for o in small.generate(prompts, greedy)] == alone
    assert small.stats().num_preemptions > 0, "the pool was meant to be small enough to force preemption"


def test_qwen3_moe_layers_follow_mlp_only_layers_and_decoder_sparse_step(tiny_model_factory):
    from pagecli.models.spec import DecoderSpec
    from tiny_models import tiny_config

    spec = DecoderSpec.from_hf_config(tiny_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                                  mlp_only_layers=[3]))
    assert spec.moe_layers == (False, True, False, False) and spec.one_call_shaped
    model = load_model(tiny_model_factory("qwen3_moe"), "float32", "cpu", max_positions=64).model
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoE", "GatedMLP", "SparseMoE"]


def _write_config(folder, **fields) -> None:
    base = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    (folder / "config.json").write_text(json.dumps({**base, **fields}))


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0},
     "clip_qkv = 8.0; pagecli does not clamp"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok 3 but only 2 experts"),
    ({"model_type": "qwen2_moe"}, "'qwen2_moe' is not supported.*Mixtral.*Qwen3-MoE.*OLMoE"),
])
def test_an_unsupported_mixture_of_experts_is_one_clear_error(tmp_path, fields, message):
    _write_config(tmp_path, **fields)
    with pytest.raises(ModelError, match=message):
        load_model(tmp_path, "float32", "cpu")
