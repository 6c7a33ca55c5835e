"""The lean decoders equal transformers on the same weights: logits after prefill and after decoding.

Tolerance: float32, max absolute logit difference below 1e-4 (the logits of these tiny models
are O(1); the differences come from a different summation order in attention and matmuls).
"""

from __future__ import annotations

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from engine_probes import recorded_logits
from pagecli.models.loader import load_model
from tiny_models import ARCHS

LOGIT_ATOL = 1e-4
DECODE_STEPS = 24


def engine_for(folder, **config) -> Engine:
    cfg = EngineConfig(dtype="float32", device="cpu", attention="torch", **{"num_blocks": 128, "block_size": 4, **config})
    return Engine(config=cfg, loaded=load_model(folder, "float32", "cpu", max_positions=512))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_after_prefill_and_decode(arch, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    logits = recorded_logits(engine)
    prompt = "The quick brown fox jumps over the lazy dog. Paged attention keeps"
    [out] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True))
    prompt_ids = engine.encode(prompt)
    full = torch.tensor([prompt_ids + list(out.token_ids)])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(full).logits[0]  # [seq_len, vocab]
    assert len(logits) == DECODE_STEPS
    for step, got in enumerate(logits):
        position = len(prompt_ids) - 1 + step
        diff = (got[0] - ref[position]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch}: step {step} logits differ by {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(arch, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory(arch)
    engine = engine_for(folder)
    prompts = ["Hello world! How are you", "Très bien, merci. 日本語", "def main():\n    print("]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = engine.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)[0][len(ids):]
        assert list(out.token_ids) == ref.tolist()


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json

    from pagecli.errors import ModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelError, match="Llama 2/3.*Mistral.*Qwen2.*Qwen3"):
        load_model(tmp_path, "float32", "cpu")
