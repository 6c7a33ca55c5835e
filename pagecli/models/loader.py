"""Load a Hugging Face folder into the lean decoder: config, tokenizer, safetensors weights.

Config and tokenizer are read without transformers where pagecli can read them alone (a plain
config.json, a generic tokenizer.json: importing transformers costs most of a one-prompt start),
else through transformers. Nothing in the folder runs: transformers gets trust_remote_code=False
(left unset, it asks on stdin whether to import the folder's .py files named by auto_map, and a
chat piped into pagecli could answer), and weights come from safetensors only, never from a
pickle (.bin, .pt).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagecli.errors import ModelError
from pagecli.models.decoder import CausalLM
from pagecli.models.layers import RotaryEmbedding
from pagecli.models.spec import SUPPORTED_MODEL_TYPES, DecoderSpec, rope_type_of
from pagecli.models.tokenizer import GENERIC_TOKENIZER_CLASSES, load_plain_tokenizer
from pagecli.native import cpu_has_bf16

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: CausalLM
    spec: DecoderSpec
    hf_config: Any
    tokenizer: Any
    folder: Path
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: frozenset[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("No CUDA GPU is available; use --device cpu (or the default 'auto').")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    stored = stored if stored in _DTYPES.values() else torch.float32
    if device.type == "cuda" and stored == torch.float32:
        return torch.bfloat16
    if device.type == "cpu" and stored in (torch.float32, torch.bfloat16):
        # bfloat16 halves the bytes read per token, and CPUs with AVX512-BF16 compute in it natively
        # (about 2x the decode speed of float32; float32 stays available for exact parity).
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if device.type == "cpu" and stored == torch.float16:
        return torch.float32  # float16 matmuls on CPU are slow and lose precision
    return stored


# Keys a config.json must carry for pagecli to read it without transformers' config classes, whose
# import pulls in most of the library (about 3 s on a small machine, for every one-prompt run).
# Where a class fills in a default of its own (Qwen's sliding window switch, Qwen3's head size),
# that key is required too; any other config goes through AutoConfig.
_PLAIN_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "rms_norm_eps")
_PLAIN_CONFIG_KEYS_BY_TYPE = {"qwen2": ("use_sliding_window",), "qwen3": ("use_sliding_window", "head_dim")}
# Gemma and Phi-3 configs always go through their classes, which fill in layer types, rope tables and more.
_PLAIN_CONFIG_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The weights' shapes: transformers' config classes default them to a 7B model's, which no checkpoint of
# another size matches, so a config.json of ours that lacks one is refused instead of defaulted.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def load_hf_config(folder: Path) -> Any:
    """The model's config: config.json as attributes when pagecli can read it alone (a supported
    architecture with plain rope, nothing custom), else transformers' AutoConfig."""
    data = _config_json(folder)
    _require_shape_keys(data, folder / "config.json")
    plain = _plain_config_of(data)
    if plain is not None:
        return plain
    from huggingface_hub import errors as hub_errors  # transformers imports it anyway
    from transformers import AutoConfig

    # transformers 5 checks field types and head counts with huggingface_hub's strict dataclasses
    # (earlier versions raise ValueError, which the first clause words).
    strict_dataclass_error = getattr(hub_errors, "StrictDataclassError", ValueError)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        _refuse_remote_code(exc, folder, "config", "config.json")
        raise ModelError(f"Cannot read the model config in '{folder}': {_first_line(exc)}") from exc
    except strict_dataclass_error as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ModelError(f"The model config '{folder / 'config.json'}' is invalid: {message}") from exc


def read_spec(folder: Path) -> DecoderSpec:
    """The checked DecoderSpec of a model folder, from its config alone."""
    return DecoderSpec.from_hf_config(load_hf_config(folder), folder / "config.json")


def _config_json(folder: Path) -> dict[str, Any] | None:
    """config.json as a dict; None when it is unreadable or not an object (AutoConfig words that error)."""
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _require_shape_keys(data: dict[str, Any] | None, path: Path) -> None:
    if data is None or data.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return  # an unsupported architecture is refused by name later
    missing = [key for key in _SHAPE_KEYS if key not in data]
    if missing:
        raise ModelError(f"The model config '{path}' has no {', '.join(missing)}; pagecli needs "
                         f"{'it' if len(missing) == 1 else 'them'} to build the model.")


def _plain_config(folder: Path) -> SimpleNamespace | None:
    return _plain_config_of(_config_json(folder))


def _plain_config_of(data: dict[str, Any] | None) -> SimpleNamespace | None:
    """config.json's dict as attributes, where pagecli can read it alone (load_hf_config)."""
    if data is None or "auto_map" in data:
        return None
    model_type = data.get("model_type")
    required = _PLAIN_CONFIG_KEYS + _PLAIN_CONFIG_KEYS_BY_TYPE.get(model_type, ())
    if model_type not in _PLAIN_CONFIG_TYPES or any(key not in data for key in required):
        return None
    config = SimpleNamespace(**data)
    if rope_type_of(config) != "default":
        return None  # scaled rope: transformers' own definitions need its config object
    return config


def load_tokenizer(folder: Path) -> Any:
    """pagecli's PlainTokenizer where the folder's tokenizer is a generic tokenizer.json that transformers
    would read no differently (no transformers import: about 0.7 s of start-up), else transformers' own."""
    try:
        plain = load_plain_tokenizer(folder)
        if plain is not None:
            return plain
        if _generic_fast_tokenizer(folder):
            # The class AutoTokenizer would pick anyway, without its model-type lookup (which
            # imports transformers' config classes).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(folder, trust_remote_code=False)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        _refuse_remote_code(exc, folder, "tokenizer", "tokenizer_config.json")
        raise ModelError(f"Cannot load the tokenizer in '{folder}': {_first_line(exc)}") from exc


def _generic_fast_tokenizer(folder: Path) -> bool:
    """Whether the folder's tokenizer is the generic fast one: a tokenizer.json that
    tokenizer_config.json names no model-specific class (and no code) for."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and (folder / "tokenizer.json").is_file() and "auto_map" not in config
            and config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES)


def _refuse_remote_code(exc: BaseException, folder: Path, what: str, file_name: str) -> None:
    """A clear ModelError if transformers failed because the folder's own code would be needed."""
    if "custom code" in str(exc):
        raise ModelError(
            f"The {what} in '{folder}' needs Python code from the model folder (auto_map in {file_name}); "
            "pagecli never runs code from a model folder. Use a model that transformers supports without it."
        ) from exc


LayerReady = Callable[[CausalLM, int], None]  # (the model, the index of the decoder layer just loaded)
# The checkpoint names of decoder layer `index` whose weights the caller puts in place itself (in layer_ready);
# index None: of the weights outside the decoder layers (the caller puts them in place after loading).
LayerProvided = Callable[[CausalLM, "int | None"], frozenset[str]]


def load_model(folder: Path, dtype: str = "auto", device: str = "auto", max_positions: int | None = None,
               layer_ready: LayerReady | None = None, layer_provided: LayerProvided | None = None,
               hf_config: Any = None) -> LoadedModel:
    """The folder's model, config and tokenizer; layer_ready(model, index) runs on each decoder layer
    as soon as its weights are loaded (_load_weights). The weights layer_provided(model, index) names
    are not read: they stay on the meta device until layer_ready replaces them (a GGUF file's blocks).
    hf_config: the folder's config where the caller has read it already (load_hf_config)."""
    hf_config = hf_config if hf_config is not None else load_hf_config(folder)
    spec = DecoderSpec.from_hf_config(hf_config, folder / "config.json")
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, hf_config, dev)
    positions = max_positions or spec.max_position_embeddings
    # Gemma 3's rope settings are per layer type: its full attention layers', and its sliding layers' own.
    global_type = "full_attention" if spec.local_rope else None
    rotary = RotaryEmbedding(hf_config, spec.head_dim, positions, global_type, spec.rotary_dim).to(dev)
    local_rotary = None
    if spec.local_rope:  # rope_local_base_freq
        local_rotary = RotaryEmbedding(hf_config, spec.head_dim, positions, "sliding_attention",
                                       spec.rotary_dim).to(dev)
    with torch.device("meta"):  # parameters get their real storage from the checkpoint
        model = CausalLM(spec, rotary, local_rotary)
    model.source_folder = folder  # before the weights: layer_ready may read a GGUF source beside it
    _load_weights(model, folder, torch_dtype, dev, layer_ready, layer_provided)
    model.eval()
    tokenizer = load_tokenizer(folder)
    return LoadedModel(model, spec, hf_config, tokenizer, folder, torch_dtype, dev, _eos_ids(folder, hf_config, tokenizer))


def _load_weights(model: CausalLM, folder: Path, dtype: torch.dtype, device: torch.device,
                  layer_ready: LayerReady | None = None, layer_provided: LayerProvided | None = None) -> None:
    """The checkpoint's tensors into the model: first those outside the decoder layers, then one layer
    at a time, its q/k/v and gate/up fused as soon as its tensors are in and the layer handed to
    layer_ready (the engine quantizes it there). Every tensor is copied out of the file's mapping,
    which is closed after each layer: a quantized model never holds more than one layer of float
    weights, and none of the file stays resident (a tensor viewing the mapping kept the whole file
    counted in the process's memory: a 7B model loaded to int4 stayed at 16 GB resident for 4.4 GB
    of weights). The weights that layer_provided names (for a layer, or None: outside the layers) are not
    read at all."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"No *.safetensors weights in '{folder}'; pagecli loads safetensors checkpoints only.")
    expected = dict(model.named_parameters())
    renames = CHECKPOINT_RENAMES.get(model.spec.model_type, ())
    where = _tensor_files(files, expected, renames)
    where.update(_held_in_gguf(folder, expected, renames))
    missing = sorted(set(expected) - set(where))
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise ModelError(f"The weights in '{folder}' lack {len(missing)} tensors the model needs ({shown}).")
    layers: dict[int, list[str]] = {}
    outside: list[str] = []
    for name in where:
        match = _LAYER_NAME.match(name)
        (layers.setdefault(int(match.group(1)), []) if match else outside).append(name)
    provided = layer_provided(model, None) if layer_provided is not None else frozenset()
    outside = [name for name in outside if name not in provided]
    model.load_state_dict(_read_tensors(outside, where, expected, dtype, device, folder), strict=False, assign=True)
    for index, layer in enumerate(model.model.layers):
        provided = layer_provided(model, index) if layer_provided is not None else frozenset()
        names = [name for name in layers.get(index, []) if name not in provided]
        # Into the layer itself: the model's load_state_dict would walk every module of the model for each layer.
        prefix = f"model.layers.{index}."
        state = _read_tensors(names, where, expected, dtype, device, folder)
        layer.load_state_dict({name.removeprefix(prefix): tensor for name, tensor in state.items()}, strict=False,
                              assign=True)
        layer.fuse_projections()
        if layer_ready is not None:
            layer_ready(model, index)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
# model_type -> (checkpoint pattern, the model's name): the one architecture whose checkpoint names differ
# from the decoder's modules. Mixtral's experts are block_sparse_moe.experts.N.w1 (gate), w3 (up), w2 (down);
# the decoder names every mixture of experts as Qwen3-MoE and OLMoE do (mlp.gate, mlp.experts.N.gate_proj).
CHECKPOINT_RENAMES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "mixtral": (
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
        (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
        (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    ),
}


@dataclass(frozen=True)
class _Stored:
    """Where a model parameter's tensor is: the file, and its name there (Mixtral's experts': another name).
    file None: left in the folder's GGUF file, dequantized when read (gguf_weights)."""

    file: Path | None
    name: str


def _model_name(name: str, renames: tuple[tuple[re.Pattern[str], str], ...]) -> str:
    for pattern, replacement in renames:
        renamed = pattern.sub(replacement, name)
        if renamed != name:
            return renamed
    return name


def _tensor_files(files: list[Path], expected: dict[str, torch.Tensor],
                  renames: tuple[tuple[re.Pattern[str], str], ...] = ()) -> dict[str, _Stored]:
    """Where each tensor the model needs is, by its parameter name, from the files' headers (no tensor read)."""
    where: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for stored in f.keys():
                    name = _model_name(stored, renames)
                    if not name.endswith(_IGNORED_WEIGHT_SUFFIXES) and name in expected:
                        where[name] = _Stored(file, stored)  # e.g. lm_head.weight of a tied checkpoint is not expected
        except (SafetensorError, OSError, ValueError) as exc:
            raise _unreadable(file, exc) from exc
    return where


def _held_in_gguf(folder: Path, expected: dict[str, torch.Tensor],
                  renames: tuple[tuple[re.Pattern[str], str], ...]) -> dict[str, _Stored]:
    """The tensors the model needs that a converted GGUF folder left in its file (gguf_weights), by parameter name."""
    from pagecli.models.gguf_weights import held_names

    where: dict[str, _Stored] = {}
    for stored in held_names(folder):
        name = _model_name(stored, renames)
        if name in expected:
            where[name] = _Stored(None, stored)
    return where


def _read_tensors(names: list[str], where: dict[str, _Stored], expected: dict[str, torch.Tensor],
                  dtype: torch.dtype, device: torch.device, folder: Path) -> dict[str, torch.Tensor]:
    """These tensors, each a copy of its own in dtype on device, shapes checked."""
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path | None, list[str]] = {}
    for name in names:
        by_file.setdefault(where[name].file, []).append(name)
    held = by_file.pop(None, [])
    if held:
        from pagecli.models.gguf_weights import read_weights

        model_names = {where[name].name: name for name in held}
        for stored, weight in read_weights(folder, list(model_names)):
            state[model_names[stored]] = torch.from_numpy(weight).to(device=device, dtype=dtype)
    for file, file_names in by_file.items():
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in file_names:
                    state[name] = f.get_tensor(where[name].name).to(device=device, dtype=dtype, copy=True)
        except (SafetensorError, OSError, ValueError) as exc:
            raise _unreadable(file, exc) from exc
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ModelError(f"Weight '{where[name].name}' in '{folder}' has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected[name].shape)}.")
    return state


def _unreadable(file: Path, exc: BaseException) -> ModelError:
    return ModelError(f"Cannot read weights from '{file}' (corrupt or truncated?): {_first_line(exc)}")


def _eos_ids(folder: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: set[int] = set()
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (OSError, json.JSONDecodeError):
            pass
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(i for i in source if isinstance(i, int))
    return frozenset(ids)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
