"""--merge-lora: one adapter merged into the weights at load gives PEFT's merged model's greedy output; several
adapters, or a base kept in a GGUF file's blocks, are one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import make_adapter, one_thread  # noqa: F401 - a fixture
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import PagecliError, RequestError
from pagecli.models.loader import load_model

TOKENS = 12


def peft_merged_greedy(base: Path, adapter: Path, prompt_ids: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        out = merged.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                              do_sample=False, pad_token_id=0)
    return out[0][len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def adapter(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    base = tiny_model_factory("llama")
    return base, make_adapter(base, tmp_path_factory.mktemp("merge") / "m", rank=8, seed=21)


def merged_engine(base: Path, loras: dict[str, Path], **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "num_blocks": 128, "block_size": 4, "disk_cache": False,
                "loras": tuple((n, str(p)) for n, p in loras.items()), "merge_lora": True, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(base, "float32", "cpu", max_positions=512))


@pytest.mark.parametrize("attention", ["torch", "auto"])
def test_a_merged_adapter_gives_peft_merged_models_greedy_output(attention, adapter):
    base, folder = adapter
    engine = merged_engine(base, {"m": folder}, attention=attention)
    ids = engine.encode("def main():\n    print(")
    expected = peft_merged_greedy(base, folder, ids)
    for lora in (None, "m"):  # the merged weights run every request; naming the adapter is the same
        [out] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, lora=lora))
        assert list(out.token_ids) == expected
    plain = Engine(config=EngineConfig(dtype="float32", device="cpu", num_blocks=128, block_size=4, disk_cache=False),
                   loaded=load_model(base, "float32", "cpu", max_positions=512))
    [out] = plain.generate([ids], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert list(out.token_ids) != expected, "the adapter should change this model's output"


def test_a_merged_adapters_prefixes_are_not_the_base_models(adapter):
    base, folder = adapter
    plain = Engine(config=EngineConfig(dtype="float32", device="cpu", num_blocks=128, block_size=4, disk_cache=False),
                   loaded=load_model(base, "float32", "cpu", max_positions=512))
    assert merged_engine(base, {"m": folder}).fingerprint != plain.fingerprint


def test_merging_several_adapters_is_one_sentence(adapter):
    base, folder = adapter
    with pytest.raises(PagecliError, match="exactly one --lora"):
        merged_engine(base, {"m": folder, "n": folder})


def test_a_merged_adapter_at_another_scale_is_refused(adapter):
    base, folder = adapter
    engine = merged_engine(base, {"m": folder})
    with pytest.raises(RequestError, match="merged into the weights"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, lora="m", lora_scale=0.5))


def test_merging_into_a_gguf_files_blocks_is_one_sentence(smollm2_dir, adapter):
    """The embedded model on its GGUF file's blocks (--quantize gguf; auto on CPUs without bf16 arithmetic) has
    no float weights to merge into: one sentence before any weight loads."""
    _, folder = adapter
    config = EngineConfig(device="cpu", quantize="gguf", disk_cache=False, loras=(("m", str(folder)),),
                          merge_lora=True)
    with pytest.raises(PagecliError, match="GGUF file's quantized blocks"):
        Engine(model=str(smollm2_dir), config=config)
