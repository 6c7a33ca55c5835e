"""What the engine needs to know about a decoder, read from a Hugging Face config.

The Llama family and close relatives share one lean implementation; each architecture
differs only in the flags below (q/k/v bias, q/k RMSNorm, tied embeddings, rope scaling).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    def from_hf_config(cls, config: Any) -> "DecoderSpec":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"Architecture '{model_type}' is not supported; pagecli runs {SUPPORTED_NAMES}."
            )
        qkv_bias_default, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ModelError(f"Activation '{hidden_act}' is not supported; pagecli's MLP is SwiGLU (silu).")
        rope_type = rope_type_of(config)
        if rope_type not in _SUPPORTED_ROPE:
            raise ModelError(f"Rope scaling '{rope_type}' is not supported; supported: {', '.join(_SUPPORTED_ROPE)}.")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = getattr(config, "attention_bias", None)
        use_sliding = getattr(config, "use_sliding_window", True)
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias_default if attention_bias is None else bool(attention_bias),
            o_bias=bool(attention_bias) if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=(getattr(config, "sliding_window", None) if use_sliding else None),
            hidden_act=hidden_act,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings in transformers' v5 shape (`rope_parameters`), or the older attributes."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type parameters: every layer here is full attention.
        params = params.get("full_attention", next(iter(params.values())))
    if not params:
        scaling = getattr(config, "rope_scaling", None) or {}
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    return dict(params)


def rope_type_of(config: Any) -> str:
    """The rope variant: "default" (plain), or a scaled one ("llama3", "linear", "yarn", ...)."""
    params = rope_parameters(config)
    return params.get("rope_type", params.get("type", "default")) or "default"
