"""LoRA adapters in GGUF files as llama.cpp's convert_lora_to_gguf.py writes them: the pairs equal the PEFT folder's
they came from (q/k rows back in Hugging Face's order), greedy output equals PEFT's, and a GGUF that is not a
LoRA adapter is one sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_helpers import make_adapter, one_thread, peft_greedy  # noqa: F401 - one_thread: an autouse fixture
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import ModelError
from pagecli.models.loader import load_model
from pagecli.models.lora import inspect_adapter, load_adapter

LLAMA_CPP = Path(os.environ.get("PAGECLI_LLAMA_CPP", "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"))
pytestmark = pytest.mark.skipif(not (LLAMA_CPP / "convert_lora_to_gguf.py").is_file(),
                                reason="llama.cpp's source is not here")


def converted(base: Path, adapter: Path, outtype: str) -> Path:
    path = adapter.with_suffix(f".{outtype}.gguf")
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    subprocess.run([sys.executable, str(LLAMA_CPP / "convert_lora_to_gguf.py"), "--base", str(base), "--outtype",
                    outtype, "--outfile", str(path), str(adapter)], env=env, check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def peft_adapter(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny llama (4 heads, 2 KV heads: q and k rows permuted differently) and a rank-8 adapter of it."""
    base = tiny_model_factory("llama")
    return base, make_adapter(base, tmp_path_factory.mktemp("gguf-lora") / "peft", rank=8, seed=41)


@pytest.mark.parametrize(("outtype", "tolerance"), [("f32", 0.0), ("f16", 1e-3)])
def test_a_gguf_adapters_pairs_are_the_peft_folders(outtype, tolerance, peft_adapter):
    base, folder = peft_adapter
    spec = load_model(base, "float32", "cpu", max_positions=64).spec
    gguf = converted(base, folder, outtype)
    pairs = [load_adapter(inspect_adapter(name, path, spec, 64), spec, torch.float32, torch.device("cpu"))
             for name, path in (("gguf", gguf), ("peft", folder))]
    for layer_gguf, layer_peft in zip(pairs[0].layers, pairs[1].layers):
        assert layer_gguf.keys() == layer_peft.keys() == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        for product, pair in layer_peft.items():
            torch.testing.assert_close(layer_gguf[product].a, pair.a, rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(layer_gguf[product].b, pair.b, rtol=tolerance, atol=tolerance)


def test_greedy_with_a_gguf_adapter_equals_peft(peft_adapter):
    base, folder = peft_adapter
    gguf = converted(base, folder, "f32")
    engine = Engine(config=EngineConfig(dtype="float32", device="cpu", num_blocks=128, block_size=4,
                                        disk_cache=False, loras=(("g", str(gguf)),)),
                    loaded=load_model(base, "float32", "cpu", max_positions=512))
    ids = engine.encode("def main():\n    print(")
    expected = peft_greedy(base, folder, ids, 12)
    sampling = {lora: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, lora=lora) for lora in ("g", None)}
    assert list(engine.generate([ids], sampling["g"])[0].token_ids) == expected
    assert list(engine.generate([ids], sampling[None])[0].token_ids) != expected, "the adapter changes the output"


def test_a_gguf_that_is_not_a_lora_adapter_is_one_sentence(peft_adapter, tmp_path):
    import gguf

    base, _ = peft_adapter
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("model")
    writer.add_tensor("blk.0.attn_q.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    spec = load_model(base, "float32", "cpu", max_positions=64).spec
    with pytest.raises(ModelError, match="is not a GGUF LoRA adapter"):
        inspect_adapter("m", path, spec, 64)
