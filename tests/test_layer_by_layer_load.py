"""Loading a checkpoint one decoder layer at a time (pagecli/models/loader.py): each layer fused and handed
to layer_ready as soon as its tensors are in, the engine quantizing it there, and no weight left viewing
the safetensors file's mapping (which kept the whole file counted as resident memory)."""

from __future__ import annotations

import pytest
import torch
from native_levels import COMPILED_LEVELS

from pagecli import native
from engine_probes import record_tensor_reads
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models import quantize as quantize_module
from pagecli.models.loader import load_model
from pagecli.models.quantize import quantize_int8
from pagecli.models.quantize_int4 import quantize_int4

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 13, 17], [3, 4], [7] * 11]


def file_mappings(suffix: str) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files whose names end with suffix."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(suffix):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def test_no_loaded_weight_views_the_checkpoint_files_mapping(tiny_model_factory):
    """A tensor read by safetensors views the file's mapping; kept, it held every page of the file read so
    far as the process's memory (a 7B model loaded to int4: 16 GB resident for 4.4 GB of weights)."""
    loaded = load_model(tiny_model_factory("llama"), dtype="float32", device="cpu")  # the checkpoint's dtype
    pointers = [p.data_ptr() for p in loaded.model.parameters()]
    assert pointers
    mapped = file_mappings(".safetensors")
    assert not [p for p in pointers if any(start <= p < end for start, end in mapped)]


def test_each_layer_is_fused_and_handed_over_before_the_next_one_loads(tiny_model_factory):
    seen = []

    def ready(model, index):
        layer = model.model.layers[index]
        later = [p for other in model.model.layers[index + 1 :] for p in other.parameters()]
        seen.append((index, hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj"),
                     hasattr(layer.mlp, "gate_up_proj"), all(p.is_meta for p in later),
                     model.model.norm.weight.is_meta))

    loaded = load_model(tiny_model_factory("llama"), dtype="bfloat16", device="cpu", layer_ready=ready)
    assert seen == [(i, True, True, True, False) for i in range(loaded.spec.num_layers)]
    assert not any(p.is_meta for p in loaded.model.parameters())


def assert_streamed_equals_after(folder, quantize: str, dtype: str = "bfloat16") -> None:
    """The engine's model quantized layer by layer as it loads, against the same checkpoint loaded whole
    and quantized after: the same tensors, the same greedy tokens."""
    config = EngineConfig(dtype=dtype, disk_cache=False, quantize=quantize)
    said = []
    with Engine(str(folder), config, progress=said.append) as engine:
        streamed = {name: t.clone() for name, t in engine.loaded.model.state_dict().items()}
        streamed_out = engine.generate(PROMPTS, GREEDY)
    assert any("as they load" in line for line in said), said
    with Engine(config=config, loaded=load_model(folder, dtype, "cpu")) as engine:
        after = engine.loaded.model.state_dict()
        after_out = engine.generate(PROMPTS, GREEDY)
    assert streamed.keys() == after.keys()
    assert all(torch.equal(streamed[name], after[name]) for name in after)
    assert [o.token_ids for o in streamed_out] == [o.token_ids for o in after_out]


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("level", ["torch", *COMPILED_LEVELS])
def test_quantizing_layers_as_they_load_gives_the_model_quantizing_after_loading_gives(
        tiny_model_factory, monkeypatch, quantize, level):
    monkeypatch.setenv("PAGECLI_CPU_ISA", level)
    monkeypatch.setattr(native, "_state", {})
    assert_streamed_equals_after(tiny_model_factory("qwen2"), quantize)  # q/k/v biases too


def test_a_gguf_models_layers_go_on_the_files_blocks_as_they_load(smollm2_dir):
    assert_streamed_equals_after(smollm2_dir, "gguf")  # streamed: the projections' floats never read


def test_the_floats_a_gguf_models_blocks_replace_are_never_read(smollm2_dir, monkeypatch):
    """--quantize gguf (the default of a float32 run on the embedded model): reading the converted floats of
    the projections the file's blocks replace took most of the start (issue 48)."""
    read = record_tensor_reads(monkeypatch)
    with Engine(str(smollm2_dir), EngineConfig(dtype="float32", disk_cache=False, quantize="gguf")) as engine:
        assert not any(p.is_meta for p in engine.loaded.model.parameters())
        assert engine.generate([[1, 2, 3]], GREEDY)[0].token_ids
        table_on_blocks = engine.plan.q8_0_as_is  # the tied table is the output layer's Q8_0 blocks
        assert (engine.loaded.model.model.embed_tokens.weight is None) == table_on_blocks
    assert [name for name in read if name.endswith("_proj.weight")] == []
    assert ("model.embed_tokens.weight" in read) != table_on_blocks
    assert "model.layers.29.input_layernorm.weight" in read


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_quantizing_a_few_rows_at_a_time_gives_what_one_call_gives(monkeypatch, quantize):
    weight = (torch.randn(37, 100, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()  # a block tail
    whole = quantize(weight)
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 3 * 100)  # 3 rows at a time: 13 parts, the last of 1
    parts = quantize(weight)
    assert len(whole) == len(parts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(whole, parts))
