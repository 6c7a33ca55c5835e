"""Mixture-of-experts GGUF files (Mixtral written as `llama`, `qwen3moe`, `olmoe`): expert metadata to config,
the stacked expert tensors split back into the checkpoint's per-expert weights, the tokenizer from the file.
An F32 file gives its Hugging Face folder's weights, logits and greedy tokens, an F16 file its greedy tokens;
a Q8_0 or Q4_0 file's experts run on the file's own blocks (--quantize gguf) and give its converted floats'
tokens; a malformed file is one ModelError. The files are written as llama.cpp's converter lays them out
(tests/tiny_gguf.py), and, where llama.cpp's source is at hand, by its convert_hf_to_gguf.py itself."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engine_probes import float32_engine as engine, greedy_tokens, recorded_logits
from llama_cpp_files import LLAMA_CPP, converted_by_llama_cpp
from pagecli.config import SamplingParams
from pagecli.errors import ModelError
from pagecli.models import gguf_blocks
from pagecli.models.moe import SparseMoE
from pagecli.models.source import resolve_model
from tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you"]
GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
LOGIT_ATOL = 1e-4


def greedy(model: str, quantize: str = "none") -> list[list[int]]:
    return greedy_tokens(model, PROMPTS, GREEDY, quantize)


# Q8_0 and Q4_0 blocks hold 32 weights of a row: experts 64 wide (the tiny models' are 48), as llama.cpp's
# converter too would keep a 48-wide down projection in floats.
BLOCK_WIDE = {"mixtral": {"intermediate_size": 64}, "qwen3_moe": {"moe_intermediate_size": 64},
              "olmoe": {"intermediate_size": 64}}


def gguf_of(tiny_model_factory, tmp_path, arch: str, kind: str = "F32", **write) -> tuple:
    folder = tiny_model_factory(arch, **(BLOCK_WIDE[arch] if kind.startswith("Q") else {}))
    path = tmp_path / f"tiny-{arch}.{kind}.gguf"
    write_tiny_gguf(folder, path, GGUF_ARCH[arch], projections=kind, **write)
    return folder, path


@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_an_f32_moe_gguf_converts_back_to_its_folders_weights_logits_and_tokens(arch, tiny_model_factory,
                                                                              tmp_path):
    from safetensors.numpy import load_file

    hf_folder, path = gguf_of(tiny_model_factory, tmp_path, arch)
    folder = resolve_model(str(path))
    config = json.loads((folder / "config.json").read_text())
    original_config = json.loads((hf_folder / "config.json").read_text())
    assert config["model_type"] == arch
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "intermediate_size", "norm_topk_prob", "mlp_only_layers"):
        assert config.get(key) == original_config.get(key), key
    original = load_file(str(hf_folder / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, weight in original.items():
        assert np.array_equal(converted[name], weight), name

    with engine(str(path)) as from_file, engine(str(hf_folder)) as from_folder:
        assert any(isinstance(layer.mlp, SparseMoE) for layer in from_file.loaded.model.model.layers)
        file_logits, folder_logits = recorded_logits(from_file), recorded_logits(from_folder)
        file_tokens = [out.token_ids for out in from_file.generate(PROMPTS, GREEDY)]
        folder_tokens = [out.token_ids for out in from_folder.generate(PROMPTS, GREEDY)]
    assert file_tokens == folder_tokens
    assert all(len(set(tokens)) > 3 for tokens in file_tokens)
    assert len(file_logits) == len(folder_logits) > 0
    for got, want in zip(file_logits, folder_logits):
        assert torch.allclose(got, want, atol=LOGIT_ATOL)


@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_an_f16_moe_gguf_gives_its_folders_weights_in_fp16_and_greedy_tokens(arch, tiny_model_factory, tmp_path):
    from safetensors.numpy import load_file

    hf_folder, path = gguf_of(tiny_model_factory, tmp_path, arch, "F16")
    folder = resolve_model(str(path))
    original = load_file(str(hf_folder / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    for name, weight in original.items():
        in_fp16 = re.search(r"(_proj|\.w[123])\.weight$", name)  # the projections and experts; norms, router in F32
        stored = weight.astype(np.float16) if in_fp16 else weight
        assert np.array_equal(converted[name], stored.astype(np.float32)), name
    if arch == "qwen3_moe":
        # Rounding to fp16 flips one router choice of the tiny Qwen3-MoE: layer 0 gives a prompt token's
        # second and third experts 0.19879 and 0.19870; its tokens then differ from the folder's, as they would
        # in transformers on these fp16 weights.
        return
    assert greedy(str(path)) == greedy(str(hf_folder))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_a_quantized_moe_ggufs_expert_blocks_give_its_converted_floats_tokens(arch, kind, tiny_model_factory,
                                                                            tmp_path, monkeypatch):
    _, path = gguf_of(tiny_model_factory, tmp_path, arch, kind)
    floats = greedy(str(path), quantize="none")
    assert len({token for tokens in floats for token in tokens}) > 3  # not one token repeated
    expert_products: dict[tuple[str, str], object] = {}
    layer = gguf_blocks.GgufBlocks.layer

    def recording(self, index):
        products = layer(self, index)
        expert_products.update({(f"{index}.{module}", product): parts for (module, product), parts in products.items()
                                if module.startswith("mlp.experts.")})
        return products

    monkeypatch.setattr(gguf_blocks.GgufBlocks, "layer", recording)
    assert greedy(str(path), quantize="gguf") == floats
    # each MoE layer's 8 experts, gate/up and down each, on the file's blocks (none left to floats)
    moe_layers = 2
    assert len(expert_products) == moe_layers * 8 * 2
    assert all(parts is not None for parts in expert_products.values())


def test_an_moe_gguf_missing_an_expert_tensor_is_named(tiny_model_factory, tmp_path):
    _, path = gguf_of(tiny_model_factory, tmp_path, "olmoe", drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ModelError, match=r"lacks blk\.1\.ffn_up_exps\.weight, one of that layer's expert tensors"):
        resolve_model(str(path))


def test_an_moe_gguf_using_more_experts_than_it_has_is_named(tiny_model_factory, tmp_path):
    _, path = gguf_of(tiny_model_factory, tmp_path, "mixtral", metadata={"expert_used_count": 9})
    with pytest.raises(ModelError, match="expert_used_count 9 for 8 experts"):
        resolve_model(str(path))


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp's source is not here")
@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_an_f16_gguf_from_llama_cpps_converter_gives_its_folders_greedy_tokens(arch, smollm2_dir, tmp_path):
    folder, path = converted_by_llama_cpp(smollm2_dir, tmp_path, arch, "f16")
    tokens = greedy(str(path))
    assert len({token for row in tokens for token in row}) > 3
    assert tokens == greedy(str(folder))


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp's source is not here")
@pytest.mark.parametrize("arch", GGUF_ARCH)
def test_a_q8_0_gguf_from_llama_cpps_converter_runs_its_expert_blocks(arch, smollm2_dir, tmp_path):
    _, path = converted_by_llama_cpp(smollm2_dir, tmp_path, arch, "q8_0")
    assert greedy(str(path), quantize="gguf") == greedy(str(path), quantize="none")


def test_a_sharded_moe_conversion_names_as_many_shards_as_it_writes(tiny_model_factory, tmp_path, monkeypatch):
    from pagecli.models import gguf_convert

    hf_folder, path = gguf_of(tiny_model_factory, tmp_path, "olmoe")
    monkeypatch.setattr(gguf_convert, "MAX_SHARD_BYTES", 60_000)  # below one stacked expert tensor (98 KB)
    folder = resolve_model(str(path))
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert {shard.name.split("-of-")[1] for shard in shards} == {f"{len(shards):05d}.safetensors"}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    assert greedy(str(path)) == greedy(str(hf_folder))
