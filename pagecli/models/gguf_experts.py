"""Mixture-of-experts GGUF files: Mixtral (llama.cpp writes it as a `llama` file with experts), Qwen3-MoE
(`qwen3moe`) and OLMoE (`olmoe`). Their expert metadata to the Hugging Face config, the file's checks, and its
stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps.weight`, [num_experts, out, in]) split into the
per-expert weights of the checkpoint's names; the router (`ffn_gate_inp`) stays one matrix.

How a file routes follows llama.cpp's graphs: Mixtral's and Qwen3-MoE's top k probabilities are renormalised,
OLMoE's are not (an `expert_weights_norm` field, where a file has one, says so instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pagecli.errors import ModelError

# GGUF architecture -> (Hugging Face model_type, architectures entry) of its mixture of experts
MOE_MODELS = {
    "llama": ("mixtral", "MixtralForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
_RENORMALISED = {"llama": True, "qwen3moe": True, "olmoe": False}  # llama.cpp's build_moe_ffn norm_w
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ROUTER_TENSOR = "ffn_gate_inp"
# GGUF expert tensor -> the checkpoint's per-expert Linear, by model_type (Mixtral's w1 gate, w3 up, w2 down)
_EXPERT_NAMES = {
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1", "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{}.w2", ROUTER_TENSOR: "block_sparse_moe.gate"},
    "default": {"ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
                "ffn_down_exps": "mlp.experts.{}.down_proj", ROUTER_TENSOR: "mlp.gate"},
}


def has_experts(architecture: str, metadata: dict[str, Any]) -> bool:
    return bool(metadata.get(f"{architecture}.expert_count", 0))


def moe_config(gguf_path: Path, architecture: str, metadata: dict[str, Any],
               tensor_shapes: dict[str, tuple[int, ...]], num_layers: int) -> dict[str, Any]:
    """The config keys of the file's mixture of experts (over the dense ones); ModelError for a file pagecli
    cannot run: another routing, shared experts, more experts per token than experts, a missing or
    misshapen expert tensor."""
    arch = architecture
    if arch not in MOE_MODELS:
        raise ModelError(f"GGUF file '{gguf_path}' holds a '{arch}' mixture of experts; pagecli runs the "
                         f"mixtures of experts of these GGUF architectures only: {', '.join(MOE_MODELS)}.")
    num_experts = int(metadata[f"{arch}.expert_count"])
    top_k = int(metadata.get(f"{arch}.expert_used_count", 0))
    if not 0 < top_k <= num_experts:
        raise ModelError(f"GGUF file '{gguf_path}' has expert_used_count {top_k} for {num_experts} experts; a token "
                         "takes at least one expert and at most all of them, so the file is malformed.")
    gating = metadata.get(f"{arch}.expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    shared = metadata.get(f"{arch}.expert_shared_feed_forward_length") or metadata.get(
        f"{arch}.expert_shared_count")
    if gating != 1 or shared:
        raise ModelError(f"GGUF file '{gguf_path}' routes its experts with "
                         f"{'shared experts' if shared else 'a gating other than softmax'}, which pagecli's "
                         f"{MOE_MODELS[arch][0]} does not run.")
    dense_size = metadata.get(f"{arch}.feed_forward_length")
    expert_size = metadata.get(f"{arch}.expert_feed_forward_length", dense_size)
    moe_layers = [i for i in range(num_layers) if f"blk.{i}.{ROUTER_TENSOR}.weight" in tensor_shapes]
    for layer in moe_layers:
        _check_layer(gguf_path, tensor_shapes, layer, num_experts, expert_size)
    dense_layers = [i for i in range(num_layers) if i not in moe_layers]
    if dense_layers and arch != "qwen3moe":
        raise ModelError(f"GGUF file '{gguf_path}' lacks blk.{dense_layers[0]}.{ROUTER_TENSOR}.weight, the "
                         "router of that layer's experts; the file is incomplete.")
    norm = bool(metadata.get(f"{arch}.expert_weights_norm", _RENORMALISED[arch]))
    if arch == "llama":
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k, "intermediate_size": expert_size,
                "sliding_window": None}
    config = {"num_experts": num_experts, "num_experts_per_tok": top_k, "norm_topk_prob": norm}
    if arch == "qwen3moe":
        config.update(moe_intermediate_size=expert_size, intermediate_size=dense_size or expert_size,
                      mlp_only_layers=dense_layers, decoder_sparse_step=1)
    else:
        config.update(intermediate_size=expert_size)
    return config


def _check_layer(gguf_path: Path, tensor_shapes: dict[str, tuple[int, ...]], layer: int, num_experts: int,
                 expert_size: int | None) -> None:
    for kind in EXPERT_TENSORS:
        name = f"blk.{layer}.{kind}.weight"
        shape = tensor_shapes.get(name)
        if shape is None:
            raise ModelError(f"GGUF file '{gguf_path}' lacks {name}, one of that layer's expert tensors; "
                             "the file is incomplete.")
        width = shape[0] if kind == "ffn_down_exps" else shape[1]  # GGUF order: [in, out, experts]
        if len(shape) != 3 or shape[2] != num_experts or (expert_size and width != expert_size):
            raise ModelError(f"GGUF file '{gguf_path}' has {name} of shape {list(shape)}, not the "
                             f"{num_experts} experts of width {expert_size} its metadata states.")


def is_expert_tensor(layer_suffix: str) -> bool:
    return layer_suffix.removesuffix(".weight") in (*EXPERT_TENSORS, ROUTER_TENSOR)


def hf_expert_tensors(model_type: str, layer: int, layer_suffix: str,
                      weight: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's (name, weight) of one GGUF expert or router tensor of layer `layer`: a stacked expert
    tensor [num_experts, out, in] gives one [out, in] weight per expert."""
    if layer_suffix.removesuffix(".weight") == ROUTER_TENSOR:
        yield hf_expert_names(model_type, layer, layer_suffix, 1)[0], weight
        return
    names = hf_expert_names(model_type, layer, layer_suffix, len(weight))
    for name, expert_weight in zip(names, weight):
        yield name, np.ascontiguousarray(expert_weight)


def hf_expert_names(model_type: str, layer: int, layer_suffix: str, num_experts: int) -> list[str]:
    """The checkpoint names hf_expert_tensors gives one GGUF expert or router tensor, without its weights."""
    names = _EXPERT_NAMES.get(model_type, _EXPERT_NAMES["default"])
    kind = layer_suffix.removesuffix(".weight")
    if kind == ROUTER_TENSOR:
        return [f"model.layers.{layer}.{names[kind]}.weight"]
    return [f"model.layers.{layer}.{names[kind].format(expert)}.weight" for expert in range(num_experts)]
