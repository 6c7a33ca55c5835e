"""Qwen2 and Qwen3 GGUF files: metadata to config, tensor names (q/k/v biases, q/k norms) to the model's,
rows left in their order (llama.cpp reorders llama's q/k only), the tokenizer from the file. An F32 file
gives its Hugging Face folder's greedy tokens; a Q8_0 file's blocks run as they lie (--quantize gguf)
give its converted floats' tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.source import resolve_model
from tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you"]
ARCHS = ("qwen2", "qwen3")
SPREAD = {"initializer_range": 0.15}  # weights large enough that the greedy tokens vary (not one token repeated)


def greedy(model: str, quantize: str = "none") -> list[list[int]]:
    config = EngineConfig(dtype="float32", device="cpu", quantize=quantize, disk_cache=False, num_blocks=64)
    with Engine(model, config) as engine:
        return [list(out.token_ids) for out in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_gguf_converts_back_to_its_folders_weights_and_tokens(arch, tiny_model_factory, tmp_path):
    from safetensors.numpy import load_file

    hf_folder = tiny_model_factory(arch, **SPREAD)
    path = tmp_path / f"tiny-{arch}.F32.gguf"
    write_tiny_gguf(hf_folder, path, arch)
    folder = resolve_model(str(path))
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch
    original = load_file(str(hf_folder / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, weight in original.items():
        assert np.array_equal(converted[name], weight), name
    assert greedy(str(path)) == greedy(str(hf_folder))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_q8_0_ggufs_blocks_give_its_converted_floats_tokens(arch, tiny_model_factory, tmp_path):
    path = tmp_path / f"tiny-{arch}.Q8_0.gguf"
    write_tiny_gguf(tiny_model_factory(arch, **SPREAD), path, arch, projections="Q8_0")
    floats = greedy(str(path), quantize="none")
    assert all(len(set(tokens)) > 3 for tokens in floats)
    assert greedy(str(path), quantize="gguf") == floats


def test_a_gguf_of_an_architecture_pagecli_does_not_convert_is_named(tmp_path):
    import gguf

    from pagecli.errors import ModelError

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3n")  # Gemma 3n: not Gemma 3's text model
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="'gemma3n' model, but pagecli converts only these GGUF architectures: "
                                         "llama, qwen2, qwen3, qwen3moe, olmoe, gemma2, gemma3, phi3;"):
        resolve_model(str(path))


def test_pagecli_models_lists_the_architectures_and_the_gguf_files_it_converts(tmp_path, monkeypatch, capsys):
    import pagecli.cli.models_cmd  # noqa: F401 - registers `pagecli models`
    from pagecli.cli import main
    from pagecli.models.gguf_convert import SUPPORTED_GGUF_ARCHITECTURES

    monkeypatch.setenv("PAGECLI_HOME", str(tmp_path))
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "Gemma 2 (gemma2)" in listing and "Phi-3/3.5/4 (phi3)" in listing
    assert f"GGUF files of: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}." in listing
    assert {"gemma2", "gemma3", "phi3"} <= set(SUPPORTED_GGUF_ARCHITECTURES)


def gemma_header(path, arch: str, num_layers: int, pattern=None, window: int | None = 6):
    """A GGUF file of `arch` with the metadata read_gguf_config reads (no tensors: it reads none)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(512)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(64)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(384)
    if window is not None:
        writer.add_sliding_window(window)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch, num_layers, pattern, slides", [
    ("gemma2", 4, None, [True, False, True, False]),  # llama.cpp's default: Gemma 2 alternates
    ("gemma3", 7, None, [True] * 5 + [False, True]),  # ... Gemma 3 five sliding, one global
    ("gemma3", 3, [False, True, True], [False, True, True]),  # the file's own, one flag per layer
    ("gemma3", 4, 2, [True, False, True, False]),  # the file's own period
])
def test_a_gemma_ggufs_sliding_layers_are_the_files_pattern_or_llama_cpps_default(arch, num_layers, pattern, slides,
                                                                                 tmp_path):
    from pagecli.models.gguf_convert import read_gguf_config

    config = read_gguf_config(gemma_header(tmp_path / "g.gguf", arch, num_layers, pattern))
    assert config["layer_types"] == ["sliding_attention" if s else "full_attention" for s in slides]
    assert config["sliding_window"] == 6


def test_a_gemma3_gguf_without_a_window_has_only_global_layers(tmp_path):
    from pagecli.models.gguf_convert import read_gguf_config

    config = read_gguf_config(gemma_header(tmp_path / "g.gguf", "gemma3", 3, window=None))
    assert config["layer_types"] == ["full_attention"] * 3


@pytest.mark.parametrize("arch, num_layers, scalar", [("gemma2", 46, 128), ("gemma2", 4, 64), ("gemma3", 62, 128),
                                                      ("gemma3", 6, 64)])
def test_a_gemma_ggufs_score_scale_is_llama_cpps_width_for_the_27b_models_else_head_dim(arch, num_layers, scalar,
                                                                                       tmp_path):
    from pagecli.models.gguf_convert import read_gguf_config

    # 512 wide, 4 heads of 64: the 27B models (46 and 62 layers) scale by (512 / 4)^-0.5, the others by 64^-0.5
    config = read_gguf_config(gemma_header(tmp_path / "g.gguf", arch, num_layers))
    assert config["query_pre_attn_scalar"] == scalar


def test_a_gemma_gguf_whose_pattern_does_not_cover_its_layers_is_named(tmp_path):
    from pagecli.errors import ModelError
    from pagecli.models.gguf_convert import read_gguf_config

    with pytest.raises(ModelError, match="sliding_window_pattern of 2 layers for 3"):
        read_gguf_config(gemma_header(tmp_path / "g.gguf", "gemma3", 3, [True, False]))
