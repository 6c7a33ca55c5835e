"""What the engine needs to know about a decoder, read from a Hugging Face config.

The Llama family and close relatives share one lean implementation; each architecture
differs only in the flags below (q/k/v bias, q/k RMSNorm, tied embeddings, rope scaling).
Every size is checked here, where the config is read, so a malformed config.json is one
ModelError naming the file and the field, never a failure deep inside model construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagecli.errors import ModelError

# model_type -> (qkv bias default, q/k norm)
SUPPORTED_MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),  # Llama 2/3, SmolLM, SmolLM2
    "mistral": (False, False),
    "qwen2": (True, False),  # Qwen2, Qwen2.5
    "qwen3": (False, True),
}
SUPPORTED_NAMES = "Llama 2/3, SmolLM/SmolLM2 (llama), Mistral, Qwen2/Qwen2.5 (qwen2), Qwen3 (qwen3)"
_SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class DecoderSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str

    @classmethod
    def from_hf_config(cls, config: Any, source: str | Path | None = None) -> "DecoderSpec":
        """The spec of a config object; `source` (the config file, a GGUF file, a hub id) is named in errors."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"Architecture '{model_type}' is not supported; pagecli runs {SUPPORTED_NAMES}."
            )
        qkv_bias_default, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ModelError(f"Activation '{hidden_act}' is not supported; pagecli's MLP is SwiGLU (silu).")
        where = f"The model config '{source}'" if source else "The model config"
        rope_type = _checked_rope_type(config, where)
        if rope_type not in _SUPPORTED_ROPE:
            raise ModelError(f"Rope scaling '{rope_type}' is not supported; supported: {', '.join(_SUPPORTED_ROPE)}.")
        sizes = _checked_sizes(config, where)
        attention_bias = getattr(config, "attention_bias", None)
        return cls(
            model_type=model_type,
            **sizes,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias_default if attention_bias is None else bool(attention_bias),
            o_bias=bool(attention_bias) if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=hidden_act,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def _checked_sizes(config: Any, where: str) -> dict[str, Any]:
    """The spec's sizes from the config, each checked: a whole number of at least 1, heads that divide."""
    num_heads = _size(config, "num_attention_heads", where)
    hidden_size = _size(config, "hidden_size", where)
    if getattr(config, "head_dim", None) is None and hidden_size % num_heads:
        raise ModelError(f"{where} has hidden_size {hidden_size} and num_attention_heads {num_heads} and no "
                         "head_dim; hidden_size must then be a multiple of num_attention_heads.")
    num_kv_heads = _size(config, "num_key_value_heads", where, default=num_heads)
    if num_heads % num_kv_heads:
        raise ModelError(f"{where} has num_attention_heads {num_heads} and num_key_value_heads {num_kv_heads}; "
                         "the attention heads must be a multiple of the key/value heads.")
    return dict(
        vocab_size=_size(config, "vocab_size", where),
        hidden_size=hidden_size,
        intermediate_size=_size(config, "intermediate_size", where),
        num_layers=_size(config, "num_hidden_layers", where),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=_size(config, "head_dim", where, default=hidden_size // num_heads),
        rms_norm_eps=_positive_number(config, "rms_norm_eps", where),
        max_position_embeddings=_size(config, "max_position_embeddings", where, default=2048),
        sliding_window=_sliding_window(config, where),
    )


def _checked_rope_type(config: Any, where: str) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        table = getattr(config, key, None)
        if table is not None and not isinstance(table, dict):
            raise ModelError(f"{where} has {key} = {table!r}; it must be a table of rope settings (or null).")
    rope_type = rope_type_of(config)
    if not isinstance(rope_type, str):
        raise ModelError(f"{where} has rope_type = {rope_type!r}; it must be a name like 'default' or 'llama3'.")
    return rope_type


def _sliding_window(config: Any, where: str) -> int | None:
    if not getattr(config, "use_sliding_window", True) or getattr(config, "sliding_window", None) in (None, 0):
        return None  # 0 (or false) says "no window" in some configs
    return _size(config, "sliding_window", where)


def _size(config: Any, key: str, where: str, default: int | None = None) -> int:
    """A whole number of at least 1; `default` stands in for a missing (or null) key, else it is required."""
    value = getattr(config, key, None)
    if value is None:
        if default is None:
            raise ModelError(f"{where} has no {key}; pagecli needs it to build the model.")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{where} has {key} = {value!r}; it must be a whole number of at least 1.")
    return value


def _positive_number(config: Any, key: str, where: str) -> float:
    value = getattr(config, key, None)
    if value is None:
        raise ModelError(f"{where} has no {key}; pagecli needs it to build the model.")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ModelError(f"{where} has {key} = {value!r}; it must be a positive number.")
    return float(value)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings in transformers' v5 shape (`rope_parameters`), or the older attributes.
    A value that is not a table is left out here; DecoderSpec refuses it, naming the field."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type parameters: every layer here is full attention.
        params = params.get("full_attention", next(iter(params.values())))
    if not params or not isinstance(params, dict):
        scaling = getattr(config, "rope_scaling", None)
        scaling = scaling if isinstance(scaling, dict) else {}
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    return dict(params)


def rope_type_of(config: Any) -> str:
    """The rope variant: "default" (plain), or a scaled one ("llama3", "linear", "yarn", ...)."""
    params = rope_parameters(config)
    return params.get("rope_type", params.get("type", "default")) or "default"
