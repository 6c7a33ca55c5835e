"""Building blocks of the lean decoder: RMSNorm, rotary embedding, the gated MLP (SwiGLU, GeGLU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from pagecli.models.spec import rope_parameters, rope_type_of

if TYPE_CHECKING:
    from pagecli.models.lora_batch import LayerLora


class RMSNorm(nn.Module):
    # pagecli.native's add_rms_norm (the same arithmetic in one pass), when set by weight_forms.WeightPlacer.
    kernel: Callable[..., torch.Tensor] | None = None

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        if offset:
            # Gemma's norms multiply by (1 + weight): the 1 is added to the checkpoint's weight as it loads,
            # so this module and the native add_rms_norm run it unchanged (exact in float32).
            self.register_load_state_dict_pre_hook(_adding_to_weight(offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like the reference implementation, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The residual step: h += delta in place (when given), then the norm of h."""
        if self.kernel is not None and h.dim() == 2 and h.is_contiguous():
            return self.kernel(h, delta, self.weight, self.eps)
        if delta is not None:
            h += delta
        return self(h)


def _adding_to_weight(offset: float) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight"
        if key in state_dict:
            state_dict[key] = state_dict[key] + offset

    return hook


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, precomputed once (float32). layer_type: the
    layers whose rope settings these are, where they differ per type (Gemma 3's sliding_attention);
    rotary_dim: the rotated part of each head (partial rotary), the whole head when None."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, scaling = _inv_freq(hf_config, self.rotary_dim, layer_type)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions.unsqueeze(1) * inv_freq  # [max_positions, rotary_dim / 2]
        long = _longrope_long_freq(hf_config, layer_type)
        if long is not None:
            # Longrope (Phi-3): positions past the pretraining length take the long factors, each position
            # always the same (as vLLM does; transformers switches a whole forward by its longest position,
            # which gives the same numbers while a sequence stays within that length).
            long_inv, original_max = long
            freqs[original_max:] = positions[original_max:].unsqueeze(1) * long_inv
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.partial = self.rotary_dim != head_dim
        self.kernel: Callable[..., None] | None = None  # pagecli.native's rotary_ (in place), when set

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, kv_heads, head_dim]
        if self.kernel is not None:
            # In place on the rotated part (a strided view the kernel writes through).
            self.kernel(q[..., :self.rotary_dim], positions, self.cos, self.sin)
            self.kernel(k[..., :self.rotary_dim], positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            return (torch.cat((_rotate(q[..., :self.rotary_dim], cos, sin), q[..., self.rotary_dim:]), dim=-1),
                    torch.cat((_rotate(k[..., :self.rotary_dim], cos, sin), k[..., self.rotary_dim:]), dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _inv_freq(hf_config: Any, rotary_dim: int, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [rotary_dim / 2] and the factor on cos/sin (longrope: its short factors)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = rope_type_of(hf_config, layer_type)
    if rope_type == "default":
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        return inv, 1.0
    # transformers owns the scaled variants (llama3, linear, yarn, ...): use its definitions.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    by_type = {} if layer_type is None else {"layer_type": layer_type}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **by_type)
    return inv.float(), float(scaling)


def _longrope_long_freq(hf_config: Any, layer_type: str | None) -> tuple[torch.Tensor, int] | None:
    """Longrope's inverse frequencies past the pretraining length, and that length; None for other ropes."""
    if rope_type_of(hf_config, layer_type) != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf_config, layer_type)
    original_max = int(params.get("original_max_position_embeddings")
                       or getattr(hf_config, "original_max_position_embeddings"))
    by_type = {} if layer_type is None else {"layer_type": layer_type}
    inv, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, torch.device("cpu"), seq_len=original_max + 1, **by_type)
    return inv.float(), original_max


# pagecli.native's bf16 product: it picks AMX tiles, its few-row AVX512-BF16 kernel or oneDNN by
# shape and CPU (linear.cpp, native_linear), and leaves any other dtype to F.linear.
LinearKernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kernel: LinearKernel | None = None) -> torch.Tensor:
    """F.linear, or the compiled kernel for a bf16 product of a batch of token rows."""
    if kernel is not None and x.dim() == 2 and x.dtype == torch.bfloat16:
        return kernel(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameter names) that can hand bf16 products to a compiled kernel.
    Its weights always come from a checkpoint, so it skips the random init (which, on the meta
    device the model is built on, makes torch import its compiler stack: about 1.7 s).

    Once given a product (use_product: panels, int8, 4-bit, a GGUF file's blocks), the weight lives only in
    the product's layout: `weight` is None and `packed_weight` holds what is kept."""

    kernel: LinearKernel | None = None
    packed: Any = None  # PackedLinear, F32PanelLinear, PackedLinearInt8, ...: what runs the product, once set
    keeps_floats = False  # never quantized (a mixture of experts' router: rounding it could pick other experts)

    def reset_parameters(self) -> None:
        pass

    def use_product(self, product: Any, kept: dict[str, torch.Tensor]) -> None:
        """Run on `product` (built by pagecli.models.weight_forms from this weight) in place of `weight`, which
        goes; `kept` are the tensors the product reads, held as parameters under their names
        (packed_weight, weight_scale, weight_min) so the model's byte counts see the real layout."""
        self.packed = product
        self.weight = None
        for name, tensor in kept.items():
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.forward(x)
        return linear(x, self.weight, self.bias, self.kernel)


class Embedding(nn.Embedding):
    """nn.Embedding without the random init, for the same reason as Linear. When the output layer
    shares its table and runs on the packed GEMM, the table is kept only packed (`weight` None) and
    rows are read back from the panels: the same values, one copy of the bytes. Likewise on a GGUF file's
    Q8_0 blocks as they lie (read_rows_from: the table's values are those blocks, dequantized)."""

    packed: Any = None  # the output layer's PackedLinear, whose panels hold this table

    def reset_parameters(self) -> None:
        pass

    def share_packed(self, packed: Any) -> None:
        self.packed = packed
        self.weight = None
        self.packed_weight = nn.Parameter(packed.panels, requires_grad=False)

    def read_rows_from(self, source: Any) -> None:
        """Look rows up in `source` (its `rows(ids)` gives this table's exact rows) and drop the table; the
        bytes stay counted where the source's owner keeps them (the output layer's product)."""
        self.packed = source
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.rows(input_ids)
        return super().forward(input_ids)


def concat_linears(linears: list[nn.Linear]) -> Linear:
    """One Linear whose output is the concatenation of the given Linears' outputs. Weights left on the meta
    device (load_model's layer_provided: a GGUF file's blocks replace them) give a meta weight."""
    if any(lin.weight.is_meta for lin in linears):
        # torch.cat of meta tensors runs Python meta kernels that import torch._dynamo: seconds at start.
        out_features = sum(lin.weight.shape[0] for lin in linears)
        weight = torch.empty(out_features, linears[0].weight.shape[1], dtype=linears[0].weight.dtype, device="meta")
    else:
        weight = torch.cat([lin.weight for lin in linears], dim=0)  # [sum(out_features), in_features]
    has_bias = linears[0].bias is not None
    fused = Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_tanh, Gemma). fused: the checkpoint holds
    gate and up as one gate_up_proj already (Phi-3), gate's rows first."""

    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # pagecli.native's silu_mul (SwiGLU only), when set

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str = "silu",
                 fused: bool = False) -> None:
        super().__init__()
        self.activation = activation
        self.intermediate = intermediate
        if fused:
            self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        else:
            self.gate_proj = Linear(hidden, intermediate, bias=bias)
            self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj (checkpoint names) by one gate_up_proj (done already when fused)."""
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """lora: the step's adapter rows for this layer (models/lora_batch.LayerLora), None for the base only."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add("gate_up_proj", x, gate_up)
        if self.kernel is not None and gate_up.dim() == 2:
            hidden = self.kernel(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = _ACTIVATIONS[self.activation](gate) * up
        return self.down_proj(hidden) if lora is None else lora.add("down_proj", hidden, self.down_proj(hidden))
