"""Safety: a model folder never runs code, nothing is unpickled, pagecli's own directories are private."""

from __future__ import annotations

import ast
import builtins
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from pagecli.errors import ModelError
from pagecli.models.loader import load_model
from pagecli.models.source import resolve_model

PACKAGE = Path(__file__).parent.parent / "pagecli"

# Imported, the module writes the marker file: the proof that code from the folder ran.
_PAYLOAD = """
from pathlib import Path
Path({marker!r}).write_text("code from the model folder ran")
from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.fixture()
def marker(tmp_path) -> Path:
    return tmp_path / "remote-code-ran"


@pytest.fixture()
def always_yes(monkeypatch):
    """A user (or a stdin line) that answers 'y' to transformers' "run the custom code?" prompt."""
    asked: list[str] = []

    def answer(prompt: str = "") -> str:
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", answer)
    return asked


def malicious_folder(tiny_llama: Path, tmp_path: Path, marker: Path, model_type: str) -> Path:
    """A copy of the tiny model with evil.py, and auto_map entries in its config and tokenizer config
    that name classes in it (what a hub repo with custom code ships)."""
    folder = Path(shutil.copytree(tiny_llama, tmp_path / f"evil-{model_type}"))
    (folder / "evil.py").write_text(_PAYLOAD.format(marker=str(marker)))
    _edit_json(folder / "config.json", model_type=model_type, architectures=["EvilModel"],
               auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
               auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return folder


# --- no code from the model folder ------------------------------------------------------------------
def test_a_known_architecture_with_auto_map_loads_with_our_classes_and_runs_no_folder_code(
        tiny_llama, tmp_path, marker, always_yes):
    folder = malicious_folder(tiny_llama, tmp_path, marker, model_type="llama")
    _edit_json(folder / "config.json", architectures=["LlamaForCausalLM"])
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    loaded = load_model(resolve_model(str(folder)), "float32", "cpu")
    assert type(loaded.tokenizer).__module__.startswith("transformers.")
    assert not marker.exists() and always_yes == []


def test_an_unknown_architecture_with_auto_map_is_refused_without_asking_or_running_folder_code(
        tiny_llama, tmp_path, marker, always_yes):
    folder = malicious_folder(tiny_llama, tmp_path, marker, model_type="evil")
    with pytest.raises(ModelError, match="Architecture 'evil' is not supported|never runs code"):
        load_model(resolve_model(str(folder)), "float32", "cpu")
    assert not marker.exists()
    assert always_yes == [], "transformers asked whether to run the folder's code"


def test_a_custom_tokenizer_class_of_a_known_architecture_is_refused_without_running_folder_code(
        tiny_llama, tmp_path, marker, always_yes):
    folder = malicious_folder(tiny_llama, tmp_path, marker, model_type="llama")
    _edit_json(folder / "config.json", architectures=["LlamaForCausalLM"])
    with pytest.raises(ModelError, match=r"The tokenizer in .* needs Python code from the model folder .*"
                                         r"pagecli never runs code from a model folder"):
        load_model(resolve_model(str(folder)), "float32", "cpu")
    assert not marker.exists()
    assert always_yes == [], "transformers asked whether to run the folder's code"


def test_the_generate_command_on_a_malicious_folder_fails_with_one_line_and_runs_nothing(
        tiny_llama, tmp_path, marker, capsys):
    from pagecli.cli import main

    folder = malicious_folder(tiny_llama, tmp_path, marker, model_type="evil")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "y"}\n')
    code = main(["generate", str(prompts), "-o", str(tmp_path / "out.jsonl"), "-m", str(folder), "--no-disk-cache"])
    assert code != 0
    assert "Error:" in capsys.readouterr().err
    assert not marker.exists()


def test_a_gguf_file_beside_a_malicious_tokenizer_config_runs_no_folder_code(
        tiny_llama, tmp_path, marker, always_yes):
    from test_model_source import write_tiny_llama_gguf

    folder = tmp_path / "downloads"
    folder.mkdir()
    write_tiny_llama_gguf(tiny_llama, folder / "tiny.F32.gguf")
    (folder / "evil.py").write_text(_PAYLOAD.format(marker=str(marker)))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}))
    try:
        resolve_model(str(folder / "tiny.F32.gguf"))
    except ModelError:
        pass  # refusing is fine; running the folder's code is not
    assert not marker.exists()
    assert always_yes == [], "transformers asked whether to run the folder's code"


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.expr) -> str:
    return ast.unparse(func)


def _package_trees():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 30
    return [(path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(), str(path))) for path in files]


def test_trust_remote_code_is_never_passed_true_anywhere_in_the_package():
    offenders = []
    for path, tree in _package_trees():
        for call in _calls(tree):
            for keyword in call.keywords:
                if keyword.arg == "trust_remote_code" and not (
                        isinstance(keyword.value, ast.Constant) and keyword.value.value is False):
                    offenders.append(f"{path}:{call.lineno}")
                if keyword.arg is None:  # **kwargs could carry it: only allowed where no from_pretrained is called
                    assert not _name(call.func).endswith("from_pretrained"), f"{path}:{call.lineno}"
    assert offenders == []


def test_the_loader_refuses_remote_code_explicitly():
    """trust_remote_code=None (the default) lets transformers ask on stdin; the loader says False."""
    tree = ast.parse((PACKAGE / "models" / "loader.py").read_text())
    loads = [c for c in _calls(tree) if _name(c.func).endswith("from_pretrained")]
    assert loads
    for call in loads:
        values = [k.value for k in call.keywords if k.arg == "trust_remote_code"]
        assert values and isinstance(values[0], ast.Constant) and values[0].value is False, ast.unparse(call)


# --- no pickle --------------------------------------------------------------------------------------
_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "marshal", "shelve"}


def test_nothing_in_the_package_unpickles():
    offenders = []
    for path, tree in _package_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
                offenders.append(f"{path}: from {node.module} import")
        for call in _calls(tree):
            name = _name(call.func)
            keywords = {k.arg: k.value for k in call.keywords}
            weights_only = keywords.get("weights_only")
            if name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    offenders.append(f"{path}:{call.lineno}: {name} without weights_only=True")
            allow_pickle = keywords.get("allow_pickle")
            if allow_pickle is not None and not (isinstance(allow_pickle, ast.Constant) and allow_pickle.value is False):
                offenders.append(f"{path}:{call.lineno}: {name}(allow_pickle=...)")
    assert offenders == []


class _Payload:
    """Unpickled, it writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "a pickle from the model folder ran"))


def _pickled_weights(path: Path, marker: Path) -> None:
    """A pytorch_model.bin whose unpickling writes the marker (torch.save writes a pickle inside a zip)."""
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "payload": _Payload(marker)}, path)
    assert b"write_text" in path.read_bytes()


@pytest.mark.parametrize("suffix", ["pytorch_model.bin", "model.pt", "model.pth"])
def test_a_folder_with_only_pickle_weights_is_refused_with_a_clear_message(suffix, tiny_llama, tmp_path, marker):
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "pickled"))
    (folder / "model.safetensors").unlink()
    _pickled_weights(folder / suffix, marker)
    with pytest.raises(ModelError, match=r"loads only safetensors.*safe_serialization=True"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match="safetensors"):
        load_model(folder, "float32", "cpu")  # the loader alone, given the folder directly
    assert not marker.exists()


def test_pickle_weights_beside_safetensors_are_never_read(tiny_llama, tmp_path, marker):
    folder = Path(shutil.copytree(tiny_llama, tmp_path / "both"))
    _pickled_weights(folder / "pytorch_model.bin", marker)
    (folder / "training_args.bin").write_bytes(pickle.dumps(_Payload(marker)))
    loaded = load_model(resolve_model(str(folder)), "float32", "cpu")
    assert loaded.model is not None
    assert not marker.exists()


# --- private directories ------------------------------------------------------------------------------
def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_prefix_store_and_the_cache_folders_above_it_are_created_private(tiny_llama, isolated_home):
    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine
    from pagecli.paths import cache_dir, prefix_store_dir

    assert not cache_dir().exists()
    config = EngineConfig(dtype="float32", device="cpu", attention="torch", block_size=4, num_blocks=64,
                          disk_cache_all_prompts=True)
    engine = Engine(config=config, loaded=load_model(tiny_llama, "float32", "cpu"))
    engine.generate(["The quick brown fox jumps over the lazy dog."], SamplingParams(temperature=0, max_tokens=1))
    engine.close()
    blob_dirs = [p for p in prefix_store_dir().rglob("*") if p.is_dir()]
    assert blob_dirs, "the run wrote blobs"
    for folder in [cache_dir(), prefix_store_dir(), *blob_dirs]:
        assert _mode(folder) == 0o700, folder
    for file in prefix_store_dir().rglob("*.safetensors"):
        assert _mode(file) == 0o600, file


def test_the_converted_models_folder_is_created_private(tmp_path):
    from pagecli.paths import cache_dir, models_dir

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file" * 10)
    with pytest.raises(ModelError):
        resolve_model(str(bad))  # the models folder is made before the conversion fails
    assert _mode(models_dir()) == 0o700 and _mode(cache_dir()) == 0o700


def _save_a_session() -> Path:
    from pagecli.chat.conversation import Conversation
    from pagecli.chat.session import save_session

    return save_session("private", Conversation(), "tiny")


def test_a_saved_chat_session_file_is_private():
    assert _mode(_save_a_session()) == 0o600


def test_the_chat_sessions_folder_and_the_data_folder_above_it_are_created_private():
    from pagecli.paths import data_dir, sessions_dir

    _save_a_session()
    assert _mode(sessions_dir()) == 0o700 and _mode(data_dir()) == 0o700
