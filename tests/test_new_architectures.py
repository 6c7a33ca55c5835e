"""Gemma 2, Gemma 3 (text) and Phi-3 (with longrope, and Phi-4-mini's partial rotary) equal transformers on
the same weights: logits after prefill and each decode step within LOGIT_ATOL, and greedy tokens
token-for-token, in float32, on the compiled CPU kernels of every level this machine runs and on the
PyTorch path (PAGECLI_CPU_ISA=torch). Gemma's sliding layers stay right past their window, with chunked
prefill and prefix hits, and on the Triton kernels (interpreted here).

The tiny models (tests/tiny_models.py) have windows of 6 tokens, soft-caps small enough that tanh bends
the scores, and weights scaled so the logits spread (std about 1).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from architecture_helpers import LEVELS, at_level, engine_for, transformers_model  # noqa: F401 - at_level: a fixture
from engine_probes import recorded_logits
from native_levels import COMPILED_LEVELS
from pagecli.config import SamplingParams
from pagecli.errors import ModelError
from pagecli.models.loader import load_model

LOGIT_ATOL = 1e-4
DECODE_STEPS = 12
# Longer than the windows (6), so a sliding layer attends to less than the whole context.
PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention keeps"
GREEDY = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
ARCHS = ("gemma2", "gemma3", "phi3", "phi4")
# Which run the one-call native decode step: the Llama-shaped ones (phi3: full rotary, SwiGLU, plain attention).
DECODE_STEP = {"gemma2": False, "gemma3": False, "phi3": True, "phi4": False}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_after_prefill_and_each_decode(arch, level, at_level, tiny_model_factory):
    at_level(level)
    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    assert engine.plan.decode_step == (DECODE_STEP[arch] and level != "torch")
    logits = recorded_logits(engine)
    [out] = engine.generate([PROMPT], GREEDY)
    prompt_ids = engine.encode(PROMPT)
    assert len(prompt_ids) > 6
    with torch.no_grad():
        ref = transformers_model(folder)(torch.tensor([prompt_ids + list(out.token_ids)])).logits[0]
    assert len(logits) == DECODE_STEPS
    for step, got in enumerate(logits):
        diff = (got[0] - ref[len(prompt_ids) - 1 + step]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch} at {level}: step {step} logits differ by {diff}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, level, at_level, tiny_model_factory):
    at_level(level)
    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    prompts = ["Hello world! How are you", "Très bien, merci. 日本語", "def main():\n    print("]
    outs = engine.generate(prompts, GREEDY)
    hf = transformers_model(folder)
    # No end-of-sequence token for transformers either (ignore_eos): min_new_tokens would mask it instead.
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        ids = engine.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                          pad_token_id=0)[0][len(ids):]
        assert len(ref) == DECODE_STEPS
        assert list(out.token_ids) == ref.tolist(), f"{arch} at {level}: {prompt!r}"


@pytest.mark.parametrize("level", ["torch", COMPILED_LEVELS[-1]] if COMPILED_LEVELS else ["torch"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_sliding_layers_give_the_same_tokens_with_chunked_prefill_and_prefix_hits(
        arch, level, at_level, tiny_model_factory):
    """A prompt of several windows, prefilled in one go, in chunks of 5 (not a multiple of the block size or
    the window), and after its first part was cached by another request: the same greedy tokens."""
    at_level(level)
    folder = tiny_model_factory(arch)
    head = "Paged attention keeps the KV cache in fixed-size blocks. "
    prompt = head + "The quick brown fox jumps over the lazy dog."
    whole = engine_for(folder).generate([prompt], GREEDY)[0].token_ids
    chunked = engine_for(folder, max_num_batched_tokens=5).generate([prompt], GREEDY)[0].token_ids
    assert chunked == whole
    engine = engine_for(folder)
    engine.generate([head + "Hello"], GREEDY)
    hits_before = engine.kv.prefix_hit_tokens
    assert engine.generate([prompt], GREEDY)[0].token_ids == whole
    assert engine.kv.prefix_hit_tokens - hits_before >= 2 * 6  # a prefix of two windows or more came from the cache


def test_a_sliding_layer_reads_nothing_outside_its_window():
    """Cache slots before a query's window hold NaN: a layer that read them would give NaN; what it gives is
    attention over the window alone (every position, with any chunk or prefix)."""
    from pagecli.attention import AttentionMetadata
    from pagecli.attention.reference_backend import ReferenceAttentionBackend

    gen = torch.Generator().manual_seed(0)
    block_size, window, seq_len, q_len, heads, kv_heads, dim = 4, 5, 19, 3, 4, 2, 8
    k_cache = torch.randn(8, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(8, block_size, kv_heads, dim, generator=gen)
    table = [5, 2, 7, 0, 3]  # out of order, as the pool hands blocks out
    slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
    first_visible = seq_len - q_len - window + 1
    for position in range(first_visible):
        k_cache.view(-1, kv_heads, dim)[slots[position]] = float("nan")
        v_cache.view(-1, kv_heads, dim)[slots[position]] = float("nan")
    query = torch.randn(q_len, heads, dim, generator=gen)
    meta = AttentionMetadata.build([q_len], [seq_len], [table], slots[-q_len:], num_decode_seqs=0)
    out = ReferenceAttentionBackend().forward(query, k_cache, v_cache, meta, 0.3, softcap=2.0, window=window)
    assert torch.isfinite(out).all()
    keys = k_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)  # [seq_len, heads, dim]
    values = v_cache.view(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
    for j in range(q_len):
        position = seq_len - q_len + j
        seen = range(position - window + 1, position + 1)
        scores = torch.einsum("hd,khd->hk", query[j], keys[list(seen)]) * 0.3
        probs = (torch.tanh(scores / 2.0) * 2.0).softmax(dim=-1)
        expected = torch.einsum("hk,khd->hd", probs, values[list(seen)])
        torch.testing.assert_close(out[j], expected)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton needs a GPU or TRITON_INTERPRET=1 (conftest sets it on CPU)")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_triton_kernels_give_the_torch_backends_tokens_on_gemma(arch, tiny_model_factory):
    """Soft-capped and sliding layers in the Triton kernels (interpreted on a CPU), with chunked prefill
    past the window: the greedy tokens of the PyTorch path."""
    folder = tiny_model_factory(arch)
    prompts = [PROMPT, "Hello world! How are you"]
    outs = {}
    for attention in ("torch", "triton"):
        engine = engine_for(folder, attention=attention, max_num_batched_tokens=8)
        outs[attention] = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert outs["triton"] == outs["torch"]


def test_gemma3_with_its_vision_tower_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vocab_size": 10}))
    with pytest.raises(ModelError, match="'gemma3'.*vision.*gemma3_text"):
        load_model(tmp_path, "float32", "cpu")


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "vocab_size": 10}))
    with pytest.raises(ModelError, match="'gpt_neox' is not supported.*Gemma 2.*Gemma 3.*Phi-3"):
        load_model(tmp_path, "float32", "cpu")


def test_longrope_positions_past_the_pretraining_length_take_the_long_factors():
    """Each position's rotary is what transformers gives a forward that reaches it: the short factors within
    the pretraining length (64 here), the long ones past it (the tables are per position, so a cached
    prefix never changes)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from pagecli.models.layers import RotaryEmbedding
    from tiny_models import tiny_config

    config = tiny_config("phi3", max_position_embeddings=512)
    ours = RotaryEmbedding(config, 16, 512)
    theirs = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    for positions in (torch.arange(0, 64), torch.arange(64, 200)):
        cos, sin = theirs(x, positions[None])
        torch.testing.assert_close(ours.cos[positions], cos[0])
        torch.testing.assert_close(ours.sin[positions], sin[0])


@pytest.mark.parametrize("level", LEVELS)
def test_sliding_soft_capped_layers_read_an_int8_kv_cache_widened(level, at_level, tiny_model_factory):
    """--kv-dtype int8 on Gemma 2: the PyTorch path of its soft-capped and sliding layers widens the cache's
    rows as the kernels do; on these weights the greedy tokens are the float cache's."""
    at_level(level)
    folder = tiny_model_factory("gemma2")
    prompts = [PROMPT, "Hello world! How are you"]
    floats = [out.token_ids for out in engine_for(folder).generate(prompts, GREEDY)]
    int8 = [out.token_ids for out in engine_for(folder, kv_dtype="int8").generate(prompts, GREEDY)]
    assert int8 == floats
