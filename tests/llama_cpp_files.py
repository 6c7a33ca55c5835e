"""GGUF files made by llama.cpp's own tools from tiny random Hugging Face models, for the tests and the
benchmarks that check pagecli against llama.cpp (scripts/bench_gguf_perplexity.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# llama.cpp's own converter, from the llama-cpp-python sdist's vendored source (docs/benchmarks: how the
# benchmarks unpack it); PAGECLI_LLAMA_CPP points at another checkout.
LLAMA_CPP = Path(os.environ.get("PAGECLI_LLAMA_CPP", "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def converted_by_llama_cpp(smollm2_dir, tmp_path, arch: str, outtype: str, **config_overrides) -> tuple[Path, Path]:
    """A tiny random `arch` model with SmolLM2's tokenizer (a BPE whose pre-tokenizer the converter knows; the
    tiny models' own it refuses) and its GGUF from convert_hf_to_gguf.py --outtype outtype; config_overrides
    over the tiny config's fields."""
    folder = tmp_path / arch
    overrides = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "intermediate_size": 64,
                 "moe_intermediate_size": 64, "mlp_only_layers": []}  # llama.cpp maps no dense Qwen3-MoE layer
    if arch == "olmoe":
        overrides["rms_norm_eps"] = 1e-5  # the converter writes OLMoE's as 1e-5 whatever the config says
    overrides.update(config_overrides)
    save_random_model(folder, arch, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    # Its llama converter imports sentencepiece before looking for a tokenizer.model; a stand-in module (pagecli
    # does not depend on sentencepiece) lets it go on to the BPE tokenizer.json.
    stand_in = tmp_path / "stand-in" / "sentencepiece"
    stand_in.mkdir(parents=True, exist_ok=True)
    (stand_in / "__init__.py").write_text("class SentencePieceProcessor:\n    pass\n")
    path = tmp_path / f"{arch}.{outtype}.gguf"
    run_converter(folder, path, outtype, _CONVERT, stand_in.parent)
    return folder, path


def save_random_model(folder: Path, arch: str, **overrides) -> None:
    """A tiny random `arch` model (tiny_config's, with those of `overrides` its config has) saved in `folder`:
    norms around 1, the other weights spread widely enough that greedy picks are not near-ties."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch, **{k: v for k, v in overrides.items() if k in tiny_config(arch).to_dict()})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if "norm" in name else param.normal_(0.0, 0.15)
    model.save_pretrained(folder)


def run_converter(folder: Path, path: Path, outtype: str, script: str = "", python_path: Path | None = None) -> Path:
    """convert_hf_to_gguf.py on `folder`, writing `path`; `script` (the converter as run by _CONVERT) else the
    converter itself, with llama.cpp's gguf-py (and `python_path`) on the path."""
    paths = [str(LLAMA_CPP / "gguf-py"), *([str(python_path)] if python_path else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = (["-c", script, str(LLAMA_CPP)] if script else [str(LLAMA_CPP / "convert_hf_to_gguf.py")])
    subprocess.run([sys.executable, *command, str(folder), "--outtype", outtype, "--outfile", str(path)], env=env,
                   check=True, capture_output=True)
    return path


# convert_hf_to_gguf.py run as it is, save one thing: its Gemma 2 vocabulary is SentencePiece's only, and its
# Phi-3's too unless tokenizer_config names GPT2Tokenizer (Phi-4's); both need a tokenizer.model, which SmolLM2 has
# not. There they take the BPE tokenizer.json as its Gemma 3 (and Phi-4) do. The tensors and the model's metadata
# are the converter's own.
_CONVERT = """
import runpy, sys
source = sys.argv.pop(1)
sys.path.insert(0, source)
from conversion.gemma import Gemma2Model
from conversion.phi import Phi3MiniModel
Gemma2Model.set_vocab = Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = source + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_blocks(f32_path: Path, out_path: Path, block_type: str) -> Path:
    """A copy of an F32 GGUF file (from converted_by_llama_cpp) whose decoder layers' matrices are `block_type`
    blocks (Q4_0, Q4_1), quantized by the gguf package as llama-quantize would store them; every other tensor and
    every metadata field as they were. Stands in for llama-quantize, a CMake build these tests do without."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(f32_path)
    writer = gguf.GGUFWriter(str(out_path), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    kind = gguf.GGMLQuantizationType[block_type]
    for tensor in reader.tensors:
        weight = np.asarray(tensor.data, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if tensor.name.startswith("blk.") and weight.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
