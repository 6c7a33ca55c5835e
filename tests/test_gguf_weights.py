"""A GGUF model's converted folder holds no float32 copy of the tensors that run as blocks (Q4_0, Q4_1, Q8_0):
they stay in the file, named in the folder's record, and every path that needs their floats dequantizes them
from the file on demand (gguf_weights). Checked against "today's" folder, the one the converter wrote before
(every tensor as float32): the same floats, the same greedy tokens on the default path and --quantize none,
and a KV fingerprint that still tells files apart."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.errors import ModelError
from pagecli.models import gguf_convert, gguf_files, gguf_weights, source
from pagecli.models.fingerprint import weights_digest
from pagecli.models.gguf_convert import unpermute_rotary_rows
from pagecli.models.source import resolve_model
from tiny_gguf import write_tiny_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_random_gguf import write_random_gguf  # noqa: E402  (a script, importable once scripts/ is on the path)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you"]
SPREAD = {"initializer_range": 0.15}  # greedy tokens that vary, not one token repeated
BLOCK_TYPES = ("Q4_0", "Q8_0")


def tiny_file(tiny_model_factory, tmp_path: Path, kind: str, name: str = "tiny") -> Path:
    path = tmp_path / f"{name}.{kind}.gguf"
    write_tiny_gguf(tiny_model_factory("llama", **SPREAD), path, "llama", projections=kind)
    return path


def todays_folder(gguf_path: Path, home: Path, monkeypatch) -> Path:
    """The folder the converter wrote before the blocks stayed in the file: every tensor as float32 (under
    another PAGECLI_HOME, so it does not meet the folder under test)."""
    with monkeypatch.context() as patch:
        patch.setenv("PAGECLI_HOME", str(home))
        patch.setattr(gguf_convert, "held_in_file", lambda tensor: False)
        return resolve_model(str(gguf_path))


def greedy(model: str | Path, **settings) -> list[list[int]]:
    config = EngineConfig(dtype="float32", device="cpu", disk_cache=False, num_blocks=64, **settings)
    with Engine(str(model), config) as engine:
        return [list(out.token_ids) for out in engine.generate(PROMPTS, GREEDY)]


def safetensors_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_a_block_files_folder_holds_no_float_copy_of_its_block_tensors(kind, tiny_model_factory, tmp_path,
                                                                       monkeypatch):
    from safetensors import numpy as safetensors_numpy

    path = tiny_file(tiny_model_factory, tmp_path, kind)
    written: list[str] = []
    dequantized: list[str] = []
    save_file, dequantize = safetensors_numpy.save_file, gguf_convert.dequantized

    def spy_save(tensors, filename, metadata=None):
        written.extend(tensors)
        return save_file(tensors, filename, metadata=metadata)

    def spy_dequantize(gguf_path, tensor):
        dequantized.append(tensor.tensor_type.name)
        return dequantize(gguf_path, tensor)

    monkeypatch.setattr(safetensors_numpy, "save_file", spy_save)
    monkeypatch.setattr(gguf_convert, "dequantized", spy_dequantize)
    folder = resolve_model(str(path))
    monkeypatch.undo()

    held = gguf_weights.held_names(folder)
    projections = {name for name in written + list(held) if name.endswith("_proj.weight")}
    assert len(projections) == 2 * 7  # q, k, v, o, gate, up, down of 2 layers
    assert set(held) == projections and not projections & set(written)
    assert "F32" in dequantized and kind not in dequantized  # the conversion never made their floats
    today = todays_folder(path, tmp_path / "today-home", monkeypatch)
    # today's folder held these tensors' float32 bytes besides: that much less on disk
    assert safetensors_bytes(today) - safetensors_bytes(folder) >= 4 * sum(
        int(np.prod(weight.shape)) for name, weight in gguf_weights.checkpoint(folder).items() if name in held)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_the_floats_read_from_the_file_are_todays_and_ggufs_own(kind, tiny_model_factory, tmp_path, monkeypatch):
    from gguf import GGUFReader, dequantize
    from safetensors.numpy import load_file

    path = tiny_file(tiny_model_factory, tmp_path, kind)
    folder = resolve_model(str(path))
    ours = gguf_weights.checkpoint(folder)
    today = load_file(str(todays_folder(path, tmp_path / "today-home", monkeypatch) / "model.safetensors"))
    assert ours.keys() == today.keys()
    for name, weight in today.items():
        assert np.array_equal(ours[name], weight), name
    # and the gguf package's own dequantization, q/k rows put back in their checkpoint order
    config = json.loads((folder / "config.json").read_text())
    tensors = {tensor.name: tensor for tensor in GGUFReader(path).tensors}
    for name, gguf_name in gguf_weights.held_names(folder).items():
        tensor = tensors[gguf_name]
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(ours[name].shape)
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"]
            weight = unpermute_rotary_rows(weight, heads)
        assert np.array_equal(ours[name], weight), name


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_greedy_tokens_on_the_default_path_and_on_floats_are_todays(kind, tiny_model_factory, tmp_path,
                                                                   monkeypatch):
    path = tiny_file(tiny_model_factory, tmp_path, kind)
    today = todays_folder(path, tmp_path / "today-home", monkeypatch)
    folder = resolve_model(str(path))
    assert folder != today and gguf_weights.held_names(folder) and not gguf_weights.held_names(today)
    floats = greedy(today, quantize="none")
    assert all(len(set(tokens)) > 3 for tokens in floats)
    assert greedy(folder, quantize="none") == floats  # the floats, dequantized on demand
    assert greedy(folder, quantize="int8") == greedy(today, quantize="int8")
    assert greedy(folder) == greedy(today)  # the default path (--quantize auto)


def test_the_embedded_models_default_and_float_tokens_are_todays(smollm2_dir, smollm2_hf_dir, tmp_path):
    """The embedded Q4_1 model: today's folder (every weight as float32, beside the same file) and the folder
    without the float copy give the same greedy tokens, on the file's blocks and on floats."""
    today = Path(shutil.copytree(smollm2_hf_dir, tmp_path / "today"))
    for name in (source.CONVERTED_MARKER, "gguf-tensors.json"):  # converted from the same file
        shutil.copy(smollm2_dir / name, today / name)
    assert safetensors_bytes(smollm2_dir) * 100 < safetensors_bytes(today)
    assert greedy(smollm2_dir) == greedy(today)
    assert greedy(smollm2_dir, quantize="none") == greedy(today, quantize="none")


def test_the_fingerprint_follows_the_file_that_holds_the_blocks(tiny_model_factory, tmp_path):
    """Two Q4_0 files whose norms and embedding table are the same and whose projections differ: their folders'
    safetensors are byte for byte the same, their weights' digests differ."""
    from safetensors.numpy import load_file, save_file

    original = tiny_model_factory("llama", **SPREAD)
    other = Path(shutil.copytree(original, tmp_path / "other"))
    weights = load_file(str(other / "model.safetensors"))
    save_file({name: -weight if name.endswith("_proj.weight") else weight for name, weight in weights.items()},
              str(other / "model.safetensors"), metadata={"format": "pt"})
    first, second = tmp_path / "first.Q4_0.gguf", tmp_path / "second.Q4_0.gguf"
    write_tiny_gguf(original, first, "llama", projections="Q4_0")
    write_tiny_gguf(other, second, "llama", projections="Q4_0")
    first_folder, second_folder = resolve_model(str(first)), resolve_model(str(second))
    assert (first_folder / "model.safetensors").read_bytes() == (second_folder / "model.safetensors").read_bytes()
    assert weights_digest(first_folder) != weights_digest(second_folder)
    assert weights_digest(first_folder) == weights_digest(first_folder)


def test_a_folder_whose_file_is_gone_says_so_and_the_moved_file_loads_again(tiny_model_factory, tmp_path):
    path = tiny_file(tiny_model_factory, tmp_path, "Q8_0")
    folder = resolve_model(str(path))
    tokens = greedy(folder, quantize="none")
    moved = tmp_path / "elsewhere" / path.name
    moved.parent.mkdir()
    shutil.move(path, moved)  # keeps the time: the same converted folder
    with pytest.raises(ModelError, match="which is gone; pass the .gguf file as MODEL"):
        greedy(folder, quantize="none")
    assert resolve_model(str(moved)) == folder
    assert greedy(folder, quantize="none") == tokens


def test_converting_removes_the_float_copy_an_older_converter_made(tiny_model_factory, tmp_path):
    path = tiny_file(tiny_model_factory, tmp_path, "Q4_0")
    old = source._folder_for(path, 1)
    old.mkdir(parents=True)
    (old / source.CONVERTED_MARKER).write_text("{}")
    (old / "model.safetensors").write_bytes(b"float32 copy")
    folder = resolve_model(str(path))
    assert folder != old and not old.exists()


def test_a_full_folder_gives_transformers_every_weight(tiny_model_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = resolve_model(str(tiny_file(tiny_model_factory, tmp_path, "Q4_0")))
    expected = gguf_weights.checkpoint(folder)
    with gguf_weights.full_folder(folder) as full:
        assert full != folder
        model = AutoModelForCausalLM.from_pretrained(full)
    assert not full.exists()
    state = model.state_dict()
    for name, weight in expected.items():
        assert np.array_equal(state[name].numpy(), weight), name


def test_a_q6_k_output_layer_stays_in_the_file_as_llama_cpps_q4_0_files_keep_it(tmp_path):
    """llama-quantize keeps a Q4_0 file's output layer in Q6_K: its float32 copy alone was 14% of a 7B file.
    It stays in the file too; its floats, read on demand, are the gguf package's."""
    from gguf import GGUFReader, dequantize

    path = tmp_path / "random.Q4_0.gguf"
    write_random_gguf(path, "tiny", "Q4_0")
    folder = resolve_model(str(path))
    held = gguf_weights.held_names(folder)
    assert held["lm_head.weight"] == "output.weight" and held["model.embed_tokens.weight"] == "token_embd.weight"
    assert safetensors_bytes(folder) < 64 * 1024  # the norms: 5 x 256 floats, and the header
    output = next(tensor for tensor in GGUFReader(path).tensors if tensor.name == "output.weight")
    assert output.tensor_type.name == "Q6_K"
    lm_head = gguf_weights.checkpoint(folder)["lm_head.weight"]
    assert np.array_equal(lm_head, dequantize(output.data, output.tensor_type).reshape(lm_head.shape))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in greedy(folder))  # the output layer from the file


def test_which_tensors_stay_in_the_file():
    from types import SimpleNamespace

    def tensor(name: str, kind: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=kind))

    for kind in ("Q4_0", "Q4_1", "Q8_0"):  # the blocks that run as they lie
        assert gguf_files.held_in_file(tensor("blk.0.attn_q.weight", kind))
    assert gguf_files.held_in_file(tensor("output.weight", "Q6_K"))
    assert gguf_files.held_in_file(tensor("token_embd.weight", "Q4_K"))
    assert not gguf_files.held_in_file(tensor("blk.0.ffn_down.weight", "Q6_K"))  # a K-quant decoder matrix
    assert not gguf_files.held_in_file(tensor("blk.0.attn_norm.weight", "F32"))
    assert not gguf_files.held_in_file(tensor("output.weight", "F16"))


def test_float_products_left_over_run_on_the_float_panels(tmp_path):
    """A file whose decoder mixes blocks with another type (as Q4_K_M files do: here one ffn_down in Q6_K) and
    keeps its output layer in Q6_K, run on its blocks in float32: the decoder products that are not blocks run
    on the float panels, as a float32 model's do, not on PyTorch's float32 GEMM (which sums a few rows
    otherwise than many, so a row's logits depended on its batch); the output layer the file rounded runs on
    int8 blocks (WeightPlan.output); and a prompt's tokens are the same alone or beside another."""
    path = tmp_path / "mixed.Q4_0.gguf"
    write_random_gguf(path, "tiny", "Q4_0", {"blk.0.ffn_down.weight": "Q6_K"})
    config = EngineConfig(dtype="float32", device="cpu", disk_cache=False, num_blocks=64)
    with Engine(str(path), config) as engine:
        if engine.quantize != "gguf":
            pytest.skip("no native kernels here to run the file's blocks")
        model = engine.loaded.model
        layers = model.model.layers
        assert type(layers[0].mlp.down_proj.packed).__name__ == "F32PanelLinear"
        assert type(layers[1].mlp.down_proj.packed).__name__ == "PackedLinearInt4"
        assert engine.plan.output == "int8" and type(model.output_packed).__name__ == "PackedLinearInt8"
        together = [list(out.token_ids) for out in engine.generate(PROMPTS, GREEDY)]
        alone = [list(engine.generate([prompt], GREEDY)[0].token_ids) for prompt in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_q6_k_output_layer_runs_on_int8_blocks_close_to_its_own_values(tmp_path, dtype):
    """llama-quantize's Q6_K output layer requantized to int8 blocks of 64 (1.06 bytes a weight where the float
    panels read 2 or 4): its logits stay within 1% of the largest from the file's own Q6_K values (2% where
    the activations are rounded to int8 too, as every product of a bf16 model on the VNNI kernels rounds them)."""
    import torch
    from gguf import GGUFReader, dequantize

    path = tmp_path / "random.Q4_0.gguf"
    write_random_gguf(path, "tiny", "Q4_0")
    config = EngineConfig(dtype=dtype, device="cpu", disk_cache=False, num_blocks=64, quantize="gguf")
    with Engine(str(path), config) as engine:
        if not engine.plan.int8_native:
            pytest.skip("no native int8 kernel here")
        model = engine.loaded.model
        assert engine.plan.output == "int8" and model.output_packed is not None
        output = next(tensor for tensor in GGUFReader(path).tensors if tensor.name == "output.weight")
        weight = torch.from_numpy(dequantize(output.data, output.tensor_type).copy()).float()  # [vocab, hidden]
        hidden = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
        got = model.compute_logits(hidden.to(engine.plan.dtype))
        expected = hidden @ weight.T
    err = (got.float() - expected).abs().max() / expected.abs().max()
    bound = 0.01 if dtype == "float32" else 0.02  # bf16 activations rounded to int8 per 64 on VNNI (0.0099 on Zen 4)
    assert err < bound, f"int8 output layer off by {err:.4f} of the largest logit"
