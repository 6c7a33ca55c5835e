"""GGUF file -> Hugging Face folder (config, tokenizer, chat template, float32 safetensors of the tensors that
do not stay in the file: gguf_weights says which stay, and gives their floats on demand through hf_tensors_of).

Dequantization is exact (every quantized value becomes the float32 it stands for), and
llama.cpp's reordering of the q/k projection rows is undone (its converter reorders llama's only:
Qwen2's, Qwen3's, Gemma's and Phi-3's rotary is already the rotate-half kind), so the folder loads in
transformers and in pagecli's own decoders like any checkpoint from the Hub. A mixture of experts' stacked
expert tensors become the checkpoint's per-expert weights (gguf_experts); Gemma's and Phi-3's differences
from llama's file are gguf_families', the tokenizer gguf_tokenizer's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pagecli.errors import ModelError
from pagecli.models import gguf_experts, gguf_families
from pagecli.models.gguf_files import held_in_file, write_record
from pagecli.models.spec import SUPPORTED_GGUF_ARCHITECTURES
from pagecli.models.gguf_index import index_entries, open_reader, write_index
from pagecli.models.gguf_tokenizer import write_tokenizer

# The model types (of the converted folder) whose GGUF q/k rows llama.cpp's converter reorders: those it
# writes as `llama` files (unpermute_rotary_rows undoes it).
PERMUTED_ROTARY_ARCHITECTURES = ("llama", "mixtral")
# GGUF architecture -> (Hugging Face model_type, architectures entry)
_HF_MODEL = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    **gguf_families.HF_MODELS,
}

# Bounds the float32 weights held in memory at once; the 135M default fits in one file.
MAX_SHARD_BYTES = 2 * 1024**3

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2's q/k/v biases
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's q/k norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

Progress = Callable[[str], None]


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> None:
    """Write the HF folder for `gguf_path` into the existing, empty `out_dir`."""
    say = progress or (lambda message: None)
    say(f"Reading {gguf_path.name}")
    reader, metadata, config = _read_header(gguf_path)
    say("Writing the tensors that do not stay in the file as float32")
    _write_weights(gguf_path, reader, config, out_dir)
    write_index(index_entries(reader), gguf_path, out_dir)  # where the file's blocks lie, for --quantize gguf (gguf_index)
    say("Writing tokenizer and chat template")
    write_tokenizer(gguf_path, metadata, config["max_position_embeddings"], out_dir)
    _write_configs(config, out_dir)


def read_gguf_config(gguf_path: Path) -> dict[str, Any]:
    """The HF config (as a dict) that converting `gguf_path` would write; reads metadata only."""
    return _read_header(gguf_path)[2]


def _read_header(gguf_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    reader = open_reader(gguf_path)
    metadata = _scalar_metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        raise ModelError(
            f"GGUF file '{gguf_path}' holds a '{architecture}' model, but pagecli converts only "
            f"these GGUF architectures: {supported}; pass a Hugging Face folder or hub id instead."
        )
    # GGUF order: innermost dimension first
    tensor_shapes = {tensor.name: tuple(int(dim) for dim in tensor.shape) for tensor in reader.tensors}
    config = _decoder_config(gguf_path, architecture, metadata, tensor_shapes, _token_count(reader))
    config.update(gguf_families.family_config(gguf_path, architecture, reader, metadata, config))
    return reader, metadata, config


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    Within each head, llama.cpp interleaves the rows of the two rotary halves (row i of
    the first half, then row i of the second) for its pairwise RoPE; Hugging Face keeps
    the halves apart (rotate_half). `weight` is [num_heads * head_dim, in_features].
    """
    rows, in_features = weight.shape
    half_head_dim = rows // num_heads // 2
    # [num_heads, half_head_dim, 2, in] -> [num_heads, 2, half_head_dim, in]
    split = weight.reshape(num_heads, half_head_dim, 2, in_features).swapaxes(1, 2)
    return split.reshape(rows, in_features)


def _scalar_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar and string field; arrays (token lists, merges) are left to the tokenizer."""
    from gguf import GGUFValueType

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or not field.data:
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        if kind == GGUFValueType.STRING:
            metadata[key] = bytes(value).decode("utf-8")
        elif kind == GGUFValueType.FLOAT32:
            # Shortest decimal that round-trips: 1e-05, not 9.999999747378752e-06.
            metadata[key] = float(str(value[0]))
        else:
            metadata[key] = value[0].item()
    return metadata


def _token_count(reader: Any) -> int | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else None


def _decoder_config(
    gguf_path: Path, architecture: str, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
    token_count: int | None
) -> dict[str, Any]:
    """The Hugging Face config's keyword arguments (LlamaConfig's, Qwen2Config's, Qwen3Config's, and the
    mixtures of experts': gguf_experts) from the `<architecture>.*` and `tokenizer.ggml.*` fields."""

    def need(key: str) -> Any:
        if key not in metadata:
            raise ModelError(f"GGUF file '{gguf_path}' lacks the '{key}' field; it cannot be converted.")
        return metadata[key]

    arch = architecture
    tensor_names = set(tensor_shapes)
    experts = gguf_experts.has_experts(arch, metadata)
    if arch in gguf_experts.MOE_MODELS and arch != "llama" and not experts:
        raise ModelError(f"GGUF file '{gguf_path}' is a '{arch}' file without expert_count; it cannot be converted.")
    # Phi-3's longrope comes from its factor tensors (gguf_families)
    rebuilt_scalings = ("none", "linear", "longrope") if arch == "phi3" else ("none", "linear")
    if "rope_freqs.weight" in tensor_names or metadata.get(f"{arch}.rope.scaling.type", "none") not in rebuilt_scalings:
        raise ModelError(
            f"GGUF file '{gguf_path}' uses a RoPE scaling that pagecli cannot rebuild from GGUF; "
            "pass the model's Hugging Face folder or hub id instead."
        )

    num_heads = need(f"{arch}.attention.head_count")
    hidden_size = need(f"{arch}.embedding_length")
    model_type, hf_architecture = gguf_experts.MOE_MODELS[arch] if experts else _HF_MODEL[arch]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_architecture],
        "vocab_size": metadata.get(f"{arch}.vocab_size", token_count),
        "hidden_size": hidden_size,
        "intermediate_size": need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": need(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata.get(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads),
        "max_position_embeddings": need(f"{arch}.context_length"),
        "rms_norm_eps": need(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": metadata.get(f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(metadata),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if config["vocab_size"] is None:
        raise ModelError(f"GGUF file '{gguf_path}' has no vocabulary; it cannot be converted.")
    if metadata.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": need(f"{arch}.rope.scaling.factor")}
    if experts:
        config.update(gguf_experts.moe_config(gguf_path, arch, metadata, tensor_shapes, config["num_hidden_layers"]))
    if arch in ("qwen2", "qwen3", "qwen3moe"):
        config["use_sliding_window"] = False  # llama.cpp runs them with full attention in every layer
    if arch == "qwen2":
        config["attention_bias"] = True  # bias is default on for qwen2
    return config


def _eos_token_ids(metadata: dict[str, Any]) -> int | list[int] | None:
    """End-of-sequence plus llama.cpp's end-of-turn/end-of-message tokens, the ids generation stops on."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids: list[int] = []
    for key in keys:
        token_id = metadata.get(key)
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor of `arch`; None for one that architecture does not have."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    layer_names = {**_LAYER_TENSOR_NAMES, **gguf_families.LAYER_TENSOR_NAMES.get(arch, {})}
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


def hf_tensors_of(gguf_path: Path, tensor: Any, arch: str, config: dict[str, Any],
                  weight: np.ndarray | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for one GGUF tensor: a stacked expert tensor gives one per expert.
    weight: the tensor already dequantized (dequantized's values), else dequantized here. gguf_weights calls this for
    the tensors a converted folder leaves in the file, so they come back as the converter would have written
    them."""
    expert = _is_expert(tensor.name, config)
    hf_name = _hf_tensor_name(tensor.name, arch)
    if hf_name is None and not expert:
        raise _not_in_model(gguf_path, tensor, config)
    weight = gguf_families.hf_weight(arch, tensor.name, dequantized(gguf_path, tensor) if weight is None else weight)
    if expert:
        layer, suffix = _LAYER_TENSOR.fullmatch(tensor.name).groups()
        yield from gguf_experts.hf_expert_tensors(config["model_type"], int(layer), suffix, weight)
        return
    if config["model_type"] not in PERMUTED_ROTARY_ARCHITECTURES:
        pass
    elif tensor.name.endswith("attn_q.weight"):
        weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
    elif tensor.name.endswith("attn_k.weight"):
        weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
    yield hf_name, np.ascontiguousarray(weight)


def hf_names_of(gguf_path: Path, tensor: Any, arch: str, config: dict[str, Any]) -> list[str]:
    """The HF names hf_tensors_of gives this tensor, without reading its data."""
    if _is_expert(tensor.name, config):
        layer, suffix = _LAYER_TENSOR.fullmatch(tensor.name).groups()
        num_experts = int(tensor.shape[2]) if len(tensor.shape) == 3 else 1
        return gguf_experts.hf_expert_names(config["model_type"], int(layer), suffix, num_experts)
    hf_name = _hf_tensor_name(tensor.name, arch)
    if hf_name is None:
        raise _not_in_model(gguf_path, tensor, config)
    return [hf_name]


def _not_in_model(gguf_path: Path, tensor: Any, config: dict[str, Any]) -> ModelError:
    return ModelError(f"GGUF file '{gguf_path}' has a tensor '{tensor.name}' that a plain {config['model_type']} "
                      "model does not have; pass the model's Hugging Face folder or hub id instead.")


def dequantized(gguf_path: Path, tensor: Any) -> np.ndarray:
    """A GGUF tensor's exact float32 values, in HF's dimension order ([out, in], [experts, out, in] stacked)."""
    from gguf import dequantize

    # GGUF lists dimensions innermost first; HF is [out_features, in_features] ([experts, out, in] stacked).
    hf_shape = tuple(int(dim) for dim in reversed(tensor.shape))
    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ModelError(
            f"GGUF file '{gguf_path}' uses the {tensor.tensor_type.name} quantization, which the "
            "installed gguf package cannot dequantize; try `pip install -U gguf` or another quantization."
        ) from error
    return np.ascontiguousarray(weight, dtype=np.float32).reshape(hf_shape)


def _is_expert(gguf_name: str, config: dict[str, Any]) -> bool:
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return match is not None and gguf_experts.is_expert_tensor(match.group(2)) and (
        "num_experts" in config or "num_local_experts" in config)


def _architecture(reader: Any) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _weight_tensors(reader: Any) -> list[Any]:
    """The file's tensors that are checkpoint weights: all but those read into the config (Phi-3's rope factors)."""
    config_tensors = gguf_families.CONFIG_TENSORS.get(_architecture(reader), ())
    return [tensor for tensor in reader.tensors if tensor.name not in config_tensors]


def _write_weights(gguf_path: Path, reader: Any, config: dict[str, Any], out_dir: Path) -> None:
    """The tensors that stay in the file (gguf_files.held_in_file) named in the folder's record; the rest
    (norms, other types) as float32 in model.safetensors, or model-0000i-of-0000n.safetensors plus an index
    past MAX_SHARD_BYTES."""
    from safetensors.numpy import save_file

    arch = _architecture(reader)
    held: list[Any] = []
    written: list[Any] = []
    for tensor in _weight_tensors(reader):
        (held if held_in_file(tensor) else written).append(tensor)
    write_record(out_dir, {name: tensor.name for tensor in held
                                        for name in hf_names_of(gguf_path, tensor, arch, config)}, arch, config)
    shard_sizes: list[int] = [0]
    for tensor in written:
        # a stacked expert tensor ([in, out, experts]) is written as one weight per expert, packed as
        # hf_tensors_of yields them (so the shard count named in the files is the count written)
        pieces = int(tensor.shape[2]) if len(tensor.shape) == 3 else 1
        for _ in range(pieces):
            tensor_bytes = int(tensor.n_elements) * 4 // pieces
            if shard_sizes[-1] and shard_sizes[-1] + tensor_bytes > MAX_SHARD_BYTES:
                shard_sizes.append(0)
            shard_sizes[-1] += tensor_bytes
    num_shards = len(shard_sizes)

    def shard_name(index: int) -> str:
        return "model.safetensors" if num_shards == 1 else f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"

    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    shard_index = 0
    for tensor in written:
        for hf_name, weight in hf_tensors_of(gguf_path, tensor, arch, config):
            if shard and shard_bytes + weight.nbytes > MAX_SHARD_BYTES:
                save_file(shard, str(out_dir / shard_name(shard_index)), metadata={"format": "pt"})
                shard, shard_bytes, shard_index = {}, 0, shard_index + 1
            shard[hf_name] = weight
            shard_bytes += weight.nbytes
            weight_map[hf_name] = shard_name(shard_index)
    # written even when empty: a model folder holds *.safetensors (source.validate_model_folder)
    save_file(shard, str(out_dir / shard_name(shard_index)), metadata={"format": "pt"})

    if num_shards > 1:
        index = {"metadata": {"total_size": sum(shard_sizes)}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_configs(config: dict[str, Any], out_dir: Path) -> None:
    from transformers import (Gemma2Config, Gemma3TextConfig, GenerationConfig, LlamaConfig, MixtralConfig, OlmoeConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mixtral": MixtralConfig,
                    "qwen3_moe": Qwen3MoeConfig, "olmoe": OlmoeConfig, "gemma2": Gemma2Config,
                    "gemma3_text": Gemma3TextConfig, "phi3": Phi3Config}[config["model_type"]]
    config_class(**{key: value for key, value in config.items() if key != "model_type"}).save_pretrained(str(out_dir))
    generation_ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**{key: value for key, value in generation_ids.items() if value is not None}).save_pretrained(
        str(out_dir)
    )
