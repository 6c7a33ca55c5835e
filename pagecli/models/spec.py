"""What the engine needs to know about a decoder, read from a Hugging Face config.

The Llama family and close relatives share one lean implementation; each architecture
differs only in the flags below (q/k/v bias, q/k RMSNorm, tied embeddings, rope scaling; Gemma's
norms around each block, soft-capping and sliding layers; Phi-3's fused checkpoint and partial rotary;
the mixture-of-experts MLPs of Mixtral, Qwen3-MoE and OLMoE: how many experts, how many each token takes,
how their router weights are normalised, which layers have them).
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
    "gemma2": (False, False),
    "gemma3_text": (False, True),  # Gemma 3's text model (Gemma3ForCausalLM)
    "phi3": (False, False),  # Phi-3, Phi-3.5, Phi-4
    "mixtral": (False, False),  # Mixtral 8x7B, 8x22B
    "qwen3_moe": (False, True),  # Qwen3-30B-A3B, Qwen3-235B-A22B
    "olmoe": (False, True),  # OLMoE-1B-7B (its q/k norms span the whole projection)
}
SUPPORTED_NAMES = ("Llama 2/3, SmolLM/SmolLM2 (llama), Mistral, Qwen2/Qwen2.5 (qwen2), Qwen3 (qwen3), "
                   "Gemma 2 (gemma2), Gemma 3 text (gemma3_text), Phi-3/3.5/4 (phi3), Mixtral (mixtral), "
                   "Qwen3-MoE (qwen3_moe), OLMoE (olmoe)")
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe")
# The GGUF architectures (general.architecture) models/gguf_convert.py converts (`pagecli models` lists them).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "olmoe", "gemma2", "gemma3", "phi3")
# Architectures whose o_proj has a bias when attention_bias is set (the others' never has one).
_O_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe", "olmoe")
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Architectures whose checkpoint holds q/k/v and gate/up as one matrix each (qkv_proj, gate_up_proj).
FUSED_CHECKPOINT_TYPES = ("phi3",)
_SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    sliding_window: int | None  # the context cap of a model whose window pagecli does not apply (Mistral, Qwen2, Phi-3)
    hidden_act: str  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # Gemma's and Phi-3's differences from the Llama shape; the defaults are Llama's.
    layer_windows: tuple[int | None, ...] = ()  # per layer: the sliding window it attends in (None: all), or ()
    attn_softcap: float | None = None  # attention scores become cap * tanh(score / cap) before the softmax
    final_softcap: float | None = None  # the same on the logits
    attn_scale: float | None = None  # the score scale (Gemma: query_pre_attn_scalar^-0.5), else head_dim^-0.5
    embed_scale: float | None = None  # the embedding's rows are multiplied by this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma's (1 + weight) is 1.0
    sandwich_norms: bool = False  # a norm after attention and after the MLP too (Gemma 2 and 3)
    local_rope: bool = False  # sliding layers have rope settings of their own (Gemma 3's rope_local_base_freq)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    rotary_dim: int | None = None  # rotary on the first rotary_dim of each head (partial rotary), else all
    qk_norm_per_head: bool = True  # q/k norms over each head (Qwen3, Gemma 3), else over the whole projection (OLMoE)
    # Mixture of experts (Mixtral, Qwen3-MoE, OLMoE); num_experts 0: every layer has one dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # the top k experts a token's router picks
    moe_intermediate_size: int = 0  # each expert's gated MLP width
    norm_topk_prob: bool = False  # the k picked probabilities are renormalised to sum to 1 (Mixtral: always)
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP of intermediate_size

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def layer_has_experts(self, index: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[index]

    @property
    def masked_attention(self) -> bool:
        """Whether some layer needs soft-capping or a sliding window, which pagecli.native's attention kernels and
        its one-call decode step lack (the PyTorch path and the Triton kernels apply them)."""
        return self.attn_softcap is not None or any(window is not None for window in self.layer_windows)

    @property
    def one_call_shaped(self) -> bool:
        """Whether every layer is a shape that pagecli.native's one-call DecodeStep runs: SwiGLU, one norm
        before each block, full rotary, plain attention, q/k norms over each head or the whole projection,
        a dense MLP or a mixture of experts (the embedding and logits are outside it)."""
        return (self.hidden_act == "silu" and not self.masked_attention and not self.sandwich_norms
                and not self.local_rope and self.rotary_dim is None)

    def layer_window(self, index: int) -> int | None:
        return self.layer_windows[index] if self.layer_windows else None

    @classmethod
    def from_hf_config(cls, config: Any, source: str | Path | None = None) -> "DecoderSpec":
        """The spec of a config object; `source` (the config file, a GGUF file, a hub id) is named in errors."""
        model_type = getattr(config, "model_type", None)
        if model_type == "gemma3":
            raise ModelError("Architecture 'gemma3' (Gemma 3 with its vision tower) is not supported; pagecli runs "
                             "Gemma 3's text model (model_type gemma3_text, Gemma3ForCausalLM) and "
                             f"{SUPPORTED_NAMES}.")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"Architecture '{model_type}' is not supported; pagecli runs {SUPPORTED_NAMES}."
            )
        qkv_bias_default, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
        hidden_act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if hidden_act not in _ACTIVATIONS:
            raise ModelError(f"Activation '{hidden_act}' is not supported; pagecli's gated MLP takes "
                             f"{', '.join(_ACTIVATIONS)}.")
        where = f"The model config '{source}'" if source else "The model config"
        for layer_type in _rope_layer_types(config):
            rope_type = _checked_rope_type(config, where, layer_type)
            if rope_type not in _SUPPORTED_ROPE:
                raise ModelError(f"Rope scaling '{rope_type}' is not supported; supported: "
                                 f"{', '.join(_SUPPORTED_ROPE)}.")
        sizes = _checked_sizes(config, where)
        attention_bias = getattr(config, "attention_bias", None)
        extras = _gemma_fields(config, where, sizes) if model_type in GEMMA_TYPES else {}
        if model_type in MOE_TYPES:
            extras = _moe_fields(config, where, sizes)
        if model_type in GEMMA_TYPES:
            sizes["sliding_window"] = None  # applied per layer (layer_windows), not a cap on the context
        return cls(
            model_type=model_type,
            **sizes,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias_default if attention_bias is None else bool(attention_bias),
            o_bias=bool(attention_bias) if model_type in _O_BIAS_TYPES else False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=_ACTIVATIONS[hidden_act],
            fused_checkpoint=model_type in FUSED_CHECKPOINT_TYPES,
            rotary_dim=_rotary_dim(config, sizes["head_dim"], where),
            **extras,
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


def _gemma_fields(config: Any, where: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's differences: the layers' windows, soft-caps, the score scale, the scaled embedding,
    (1 + weight) norms and the norms after each block; Gemma 3's sliding layers have their own rope."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != sizes["num_layers"] or \
            any(kind not in ("sliding_attention", "full_attention") for kind in layer_types):
        raise ModelError(f"{where} has layer_types = {layer_types!r}; it must name sliding_attention or "
                         f"full_attention for each of its {sizes['num_layers']} layers.")
    window = _size(config, "sliding_window", where) if "sliding_attention" in layer_types else None
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return dict(
        layer_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        attn_softcap=_optional_positive(config, "attn_logit_softcapping", where),
        final_softcap=_optional_positive(config, "final_logit_softcapping", where),
        attn_scale=None if scalar is None else _positive_number(config, "query_pre_attn_scalar", where) ** -0.5,
        embed_scale=sizes["hidden_size"] ** 0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        local_rope=getattr(config, "model_type", None) == "gemma3_text",
    )


def _moe_fields(config: Any, where: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's, Qwen3-MoE's and OLMoE's experts: how many, how many a token takes, their width, whether the
    picked probabilities are renormalised (Mixtral always; the others by norm_topk_prob), and which layers
    have them (Qwen3-MoE's decoder_sparse_step and mlp_only_layers); OLMoE's q/k norms span the projection."""
    model_type = getattr(config, "model_type", None)
    key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    num_experts = _size(config, key, where)
    top_k = _size(config, "num_experts_per_tok", where)
    if top_k > num_experts:
        raise ModelError(f"{where} has num_experts_per_tok {top_k} but only {num_experts} experts; a token cannot "
                         "take more experts than there are.")
    if getattr(config, "clip_qkv", None) is not None:
        raise ModelError(f"{where} sets clip_qkv = {config.clip_qkv!r}; pagecli does not clamp q/k/v (OLMoE's "
                         "released models leave it null).")
    if getattr(config, "num_shared_experts", None) or getattr(config, "shared_expert_intermediate_size", None):
        raise ModelError(f"{where} has shared experts, which pagecli's {model_type} does not run.")
    moe_layers = tuple(True for _ in range(sizes["num_layers"]))
    if model_type == "qwen3_moe":
        step = _size(config, "decoder_sparse_step", where, default=1)
        dense = getattr(config, "mlp_only_layers", None) or []
        if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise ModelError(f"{where} has mlp_only_layers = {dense!r}; it must be a list of layer numbers.")
        moe_layers = tuple(index not in dense and (index + 1) % step == 0 for index in range(sizes["num_layers"]))
    width = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_size(config, width, where),
        norm_topk_prob=True if model_type == "mixtral" else bool(getattr(config, "norm_topk_prob", False)),
        moe_layers=moe_layers,
        qk_norm_per_head=model_type != "olmoe",
    )


def _rotary_dim(config: Any, head_dim: int, where: str) -> int | None:
    """Partial rotary (Phi-4-mini's 0.75): the rotated part of each head, None when it is all of it."""
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor is None or factor == 1.0:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
        raise ModelError(f"{where} has partial_rotary_factor = {factor!r}; it must be a number in (0, 1].")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ModelError(f"{where} has partial_rotary_factor {factor} of head_dim {head_dim}: {dim} rotated "
                         "dimensions, which must be an even number of at least 2.")
    return dim


def _optional_positive(config: Any, key: str, where: str) -> float | None:
    return None if getattr(config, key, None) is None else _positive_number(config, key, where)


def _rope_layer_types(config: Any) -> tuple[str | None, ...]:
    """The layer types with rope settings of their own (Gemma 3's), else (None,): one setting for all."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" not in params and \
            all(isinstance(value, dict) for value in params.values()):
        return tuple(params)
    return (None,)


def _checked_rope_type(config: Any, where: str, layer_type: str | None = None) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        table = getattr(config, key, None)
        if table is not None and not isinstance(table, dict):
            raise ModelError(f"{where} has {key} = {table!r}; it must be a table of rope settings (or null).")
    rope_type = rope_type_of(config, layer_type)
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


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings in transformers' v5 shape (`rope_parameters`), or the older attributes; of one
    layer type (Gemma 3's sliding_attention) where they differ per type, else of full attention layers.
    A value that is not a table is left out here; DecoderSpec refuses it, naming the field."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and params:
        params = params.get(layer_type or "full_attention", next(iter(params.values())))
    if not params or not isinstance(params, dict):
        scaling = getattr(config, "rope_scaling", None)
        scaling = scaling if isinstance(scaling, dict) else {}
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    return dict(params)


def rope_type_of(config: Any, layer_type: str | None = None) -> str:
    """The rope variant: "default" (plain), or a scaled one ("llama3", "linear", "yarn", ...)."""
    params = rope_parameters(config, layer_type)
    return params.get("rope_type", params.get("type", "default")) or "default"
