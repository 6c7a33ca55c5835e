"""Gemma 2, Gemma 3 and Phi-3 GGUF files as llama.cpp's own convert_hf_to_gguf.py writes them
(tests/llama_cpp_files.py), from tiny random Hugging Face models: metadata to config (soft-caps, windows and their layer pattern, rope bases,
Phi-3's longrope factors), tensor names to the checkpoint's (Gemma's norms after each block, Phi-3's fused qkv and
gate/up), Gemma's norm weights with llama.cpp's added 1 taken off. An F32 file gives its folder's weights, logits
within tolerance of transformers on the folder, and its greedy tokens; an F16 file its folder's greedy tokens; a
Q8_0 file's products (Phi-3's fused ones too) run on the file's blocks (--quantize gguf) and give its converted
floats' tokens, and a Q4_0 one's (the F32 file's matrices quantized by the gguf package, as llama-quantize stores
them) on the 4-bit product."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from architecture_helpers import transformers_model
from engine_probes import float32_engine as engine, greedy_tokens, recorded_logits, record_tensor_reads
from llama_cpp_files import LLAMA_CPP, converted_by_llama_cpp, with_blocks
from pagecli.config import SamplingParams
from pagecli.models import gguf_blocks
from pagecli.models.source import resolve_model

pytestmark = pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                                reason="llama.cpp's source is not here")

DECODE_STEPS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
# Longer than the Gemma windows (6 tokens), so the sliding layers attend to less than the whole context.
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you"]
LOGIT_ATOL = 1e-4
# What the files cannot say otherwise, set in the models as llama.cpp reads their files: the score scale is
# head_dim's (query_pre_attn_scalar is not stored: llama.cpp derives it), and Gemma 3's layer pattern is
# llama.cpp's default, five sliding layers and a global one (not stored either).
OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "phi3": {},
}
MODEL_TYPE = {"gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3"}
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                 "layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "hidden_activation", "rope_parameters",
                 "original_max_position_embeddings")


def greedy(model: str, quantize: str = "none") -> list[list[int]]:
    return greedy_tokens(model, PROMPTS, GREEDY, quantize)


def converted(smollm2_dir, tmp_path, arch: str, outtype: str):
    return converted_by_llama_cpp(smollm2_dir, tmp_path, arch, outtype, **OVERRIDES[arch])


def assert_checkpoint_weights(original: dict, converted_weights: dict, arch: str) -> None:
    """Every weight as the folder has it; Gemma's norms as the model multiplies by them: llama.cpp stored
    fl(1 + w), which 1 + (the converted weight) gives back exactly, as transformers' 1 + w computes it."""
    assert converted_weights.keys() == original.keys()
    for name, weight in original.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            assert np.array_equal(np.float32(1) + converted_weights[name], np.float32(1) + weight), name
        else:
            assert np.array_equal(converted_weights[name], weight), name


@pytest.mark.parametrize("arch", OVERRIDES)
def test_an_f32_gguf_gives_its_folders_config_weights_logits_and_greedy_tokens(arch, smollm2_dir, tmp_path):
    from safetensors.numpy import load_file

    hf_folder, path = converted(smollm2_dir, tmp_path, arch, "f32")
    folder = resolve_model(str(path))
    config = json.loads((folder / "config.json").read_text())
    original_config = json.loads((hf_folder / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[arch]
    for key in CONFIG_FIELDS:
        assert config.get(key) == original_config.get(key), key
    assert_checkpoint_weights(load_file(str(hf_folder / "model.safetensors")),
                              load_file(str(folder / "model.safetensors")), arch)

    with engine(str(path)) as from_file:
        outs = from_file.generate(PROMPTS, GREEDY)
        prompt_ids = [from_file.encode(prompt) for prompt in PROMPTS]
    hf = transformers_model(hf_folder)
    hf.generation_config.eos_token_id = None  # ignore_eos, as pagecli's run
    assert len({token for out in outs for token in out.token_ids}) > 3  # not one token repeated
    for ids, out in zip(prompt_ids, outs):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                                    pad_token_id=0)[0][len(ids):]
        assert list(out.token_ids) == reference.tolist(), arch
    # the first prompt alone, step by step: its prefill's last row, then each decode step's
    with engine(str(path)) as from_file:
        logits = recorded_logits(from_file)
        [out] = from_file.generate(PROMPTS[:1], GREEDY)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt_ids[0] + list(out.token_ids)])).logits[0]
    assert len(logits) == DECODE_STEPS
    for step, got in enumerate(logits):
        diff = (got[0] - reference[len(prompt_ids[0]) - 1 + step]).abs().max().item()
        assert diff < LOGIT_ATOL, f"{arch}: step {step} logits differ by {diff}"


@pytest.mark.parametrize("arch", OVERRIDES)
def test_an_f16_gguf_gives_its_folders_greedy_tokens(arch, smollm2_dir, tmp_path):
    folder, path = converted(smollm2_dir, tmp_path, arch, "f16")
    tokens = greedy(str(path))
    assert len({token for row in tokens for token in row}) > 3
    assert tokens == greedy(str(folder))


def products_on_blocks(monkeypatch) -> dict[tuple[int, str], object]:
    """Each layer's products as GgufBlocks.layer gives them, recorded as the model loads: (layer, product) -> parts."""
    on_blocks: dict[tuple[int, str], object] = {}
    layer = gguf_blocks.GgufBlocks.layer

    def recording(self, index):
        products = layer(self, index)
        on_blocks.update({(index, product): parts for (_, product), parts in products.items()})
        return products

    monkeypatch.setattr(gguf_blocks.GgufBlocks, "layer", recording)
    return on_blocks


def assert_blocks_give_the_floats_tokens(path, parts_type, monkeypatch) -> None:
    """--quantize gguf gives the converted floats' greedy tokens, every layer's four products (Phi-3's from its
    fused attn_qkv and ffn_up) on the file's blocks, and the converted floats they replace (the checkpoint's
    qkv_proj and gate_up_proj themselves in Phi-3's) never read."""
    floats = greedy(str(path), quantize="none")
    assert len({token for row in floats for token in row}) > 3
    on_blocks = products_on_blocks(monkeypatch)
    read = record_tensor_reads(monkeypatch)
    assert greedy(str(path), quantize="gguf") == floats
    assert [name for name in read if name.endswith("_proj.weight")] == []
    assert any(name.endswith("input_layernorm.weight") for name in read)
    num_layers = json.loads((resolve_model(str(path)) / "config.json").read_text())["num_hidden_layers"]
    assert len(on_blocks) == num_layers * 4
    assert all(isinstance(parts, parts_type) for parts in on_blocks.values())


@pytest.mark.parametrize("arch", OVERRIDES)
def test_a_q8_0_ggufs_products_run_on_its_blocks_and_give_its_floats_tokens(arch, smollm2_dir, tmp_path,
                                                                           monkeypatch):
    _, path = converted(smollm2_dir, tmp_path, arch, "q8_0")
    assert_blocks_give_the_floats_tokens(path, gguf_blocks.Q8Parts, monkeypatch)


@pytest.mark.parametrize("arch", OVERRIDES)
def test_a_q4_0_ggufs_products_run_on_its_blocks_and_give_its_floats_tokens(arch, smollm2_dir, tmp_path,
                                                                           monkeypatch):
    _, f32_path = converted(smollm2_dir, tmp_path, arch, "f32")
    path = with_blocks(f32_path, tmp_path / f"{arch}.Q4_0.gguf", "Q4_0")
    assert_blocks_give_the_floats_tokens(path, gguf_blocks.Int4Parts, monkeypatch)
