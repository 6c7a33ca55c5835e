"""What Gemma 2, Gemma 3 and Phi-3 GGUF files hold differently from llama's, read back into their Hugging Face
config and checkpoint names; gguf_convert does the rest.

The files are taken as llama.cpp's convert_hf_to_gguf.py writes them and as llama.cpp's loader reads them
(src/models/gemma2.cpp, gemma3.cpp, phi3.cpp): what the file leaves out is what that loader assumes, so the
converted folder runs the model llama.cpp runs from the same file. Gemma: the norms' weights are stored with
Gemma's 1 added (undone here), the layers' sliding-window pattern is llama.cpp's default unless the file names
one, the score scale is not stored (llama.cpp derives it from the 27B models' layer counts), Gemma 3's sliding
layers have their own rope base and no scaling. Phi-3: q/k/v and gate/up stay fused as in its checkpoint, its
longrope factors are tensors of the file. None of the three has its q/k rows reordered (only llama's are).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from pagecli.errors import ModelError

# GGUF architecture -> (Hugging Face model_type, architectures entry)
HF_MODELS = {
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
_GEMMA = ("gemma2", "gemma3")
_GEMMA_LAYER_NAMES = {
    # llama's ffn_norm is the norm before the MLP: HF's post_attention_layernorm there, pre_feedforward in Gemma's
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# GGUF layer tensor -> its name under model.layers.N, where it differs from llama's (gguf_convert)
LAYER_TENSOR_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",  # q, k, v rows in that order, as the checkpoint's
             "ffn_up.weight": "mlp.gate_up_proj.weight"},  # gate's rows then up's, as the checkpoint's
}
# Tensors that are config, not weights: read into the config here, not written to the checkpoint.
_ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
CONFIG_TENSORS = {"phi3": _ROPE_FACTOR_TENSORS}
# llama.cpp's sliding-window pattern when the file names none: every n-th layer (the last of each n) is global.
_DEFAULT_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp's Gemma 27B models (by layer count) scale scores by (hidden_size / heads)^-0.5, the others head_dim's.
_WIDTH_SCALED_LAYERS = {"gemma2": 46, "gemma3": 62}


def family_config(gguf_path: Path, arch: str, reader: Any, metadata: dict[str, Any],
                  config: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields of a Gemma 2, Gemma 3 or Phi-3 file beyond the common ones (gguf_convert's);
    for any other architecture, none."""
    if arch in _GEMMA:
        return _gemma_config(gguf_path, arch, reader, metadata, config)
    if arch == "phi3":
        return _phi3_config(gguf_path, reader, metadata, config)
    return {}


def hf_weight(arch: str, gguf_name: str, weight: np.ndarray) -> np.ndarray:
    """A tensor in its checkpoint's values: Gemma's norm weights less the 1 llama.cpp's converter added (Gemma's
    RMSNorm multiplies by 1 + weight; llama.cpp's by the weight). In float32, 1 + (stored - 1) is the stored
    value exactly, so the model multiplies by what llama.cpp multiplies by."""
    if arch in _GEMMA and gguf_name.endswith("norm.weight"):
        return weight - np.float32(1.0)
    return weight


def _gemma_config(gguf_path: Path, arch: str, reader: Any, metadata: dict[str, Any],
                  config: dict[str, Any]) -> dict[str, Any]:
    num_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    window = metadata.get(f"{arch}.attention.sliding_window")
    slides = window or arch == "gemma2"  # llama.cpp's Gemma 2 always slides; Gemma 3 where the file has a window
    sliding = _sliding_layers(gguf_path, arch, reader, num_layers) if slides else [False] * num_layers
    width_scaled = num_layers == _WIDTH_SCALED_LAYERS[arch]
    fields: dict[str, Any] = {
        "layer_types": ["sliding_attention" if is_sliding else "full_attention" for is_sliding in sliding],
        "sliding_window": window or 4096,  # llama.cpp's Gemma 2 default; unused where no layer slides
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if width_scaled else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": metadata.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = metadata.get("gemma2.attn_logit_softcapping", 50.0)
        return fields
    fields["final_logit_softcapping"] = fields["final_logit_softcapping"] or None  # 0 in a file: none
    # Gemma 3's global layers take the file's rope base and scaling; its sliding layers their own base, unscaled.
    global_rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if "rope_scaling" in config:
        global_rope.update(config.pop("rope_scaling"))
    local_rope = {"rope_type": "default", "rope_theta": metadata.get("gemma3.rope.freq_base_swa", 10000.0)}
    fields["rope_parameters"] = {"full_attention": global_rope, "sliding_attention": local_rope}
    return fields


def _sliding_layers(gguf_path: Path, arch: str, reader: Any, num_layers: int) -> list[bool]:
    """Which layers slide: the file's sliding_window_pattern (one flag per layer, or a period n: the last layer of
    each n is global), else llama.cpp's default period."""
    field = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    pattern = field.contents() if field is not None else _DEFAULT_SWA_PATTERN[arch]
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelError(f"GGUF file '{gguf_path}' has a sliding_window_pattern of {len(pattern)} layers for "
                             f"{num_layers}; it cannot be converted.")
        return [bool(flag) for flag in pattern]
    period = int(pattern)
    return [period == 0 or index % period < period - 1 for index in range(num_layers)]


def _phi3_config(gguf_path: Path, reader: Any, metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's rope (longrope where the file has its factors; partial rotary where rope.dimension_count is less
    than head_dim, Phi-4-mini's) and its window (0 in the file: none, Phi-4's)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    rotated = metadata.get("phi3.rope.dimension_count", config["head_dim"])
    if rotated != config["head_dim"]:
        rope["partial_rotary_factor"] = rotated / config["head_dim"]
    factors = {tensor.name: tensor for tensor in reader.tensors if tensor.name in _ROPE_FACTOR_TENSORS}
    fields: dict[str, Any] = {"sliding_window": metadata.get("phi3.attention.sliding_window") or None}
    if factors:
        if len(factors) != 2:
            raise ModelError(f"GGUF file '{gguf_path}' has one of Phi-3's two longrope factor tensors; it cannot be "
                             "converted.")
        original = metadata.get("phi3.rope.scaling.original_context_length")
        if original is None:
            raise ModelError(f"GGUF file '{gguf_path}' has longrope factors but no "
                             "phi3.rope.scaling.original_context_length; it cannot be converted.")
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    short_factor=_factors(factors["rope_factors_short.weight"]),
                    long_factor=_factors(factors["rope_factors_long.weight"]))
        fields["original_max_position_embeddings"] = original
        attention_factor = metadata.get("phi3.rope.scaling.attn_factor")
        if attention_factor is not None and not math.isclose(
                attention_factor, _longrope_attention_factor(config["max_position_embeddings"], original),
                rel_tol=1e-6):
            rope["attention_factor"] = attention_factor  # only where it is not the one transformers derives
    fields["rope_parameters"] = rope
    return fields


def _factors(tensor: Any) -> list[float]:
    """A factor tensor's values, each the shortest decimal that round-trips its float32 (as a config holds it)."""
    return [float(str(value)) for value in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _longrope_attention_factor(max_positions: int, original: int) -> float:
    scale = max_positions / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
