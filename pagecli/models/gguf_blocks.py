"""A GGUF file's Q4_0, Q4_1 and Q8_0 decoder weights read as they are (--quantize gguf), without the
float32 detour of gguf_convert, and handed to the decoder's Linears.

The block formats map onto pagecli's layouts: Q4_1 (32 weights: fp16 scale d, fp16 minimum m,
16 bytes of nibbles; w = q * d + m) is quantize_int4's layout itself; Q4_0 (fp16 d, nibbles,
w = (q - 8) * d) is the case m = -8 d (exact in fp16 and in the fp32 sum). Both then run on
pagecli.native's 4-bit kernel, the same bytes llama.cpp reads. Q8_0 (fp16 d, 32 int8; w = q * d)
runs as it is on the AVX2 int8 kernel (activations rounded to int16; float32 models on every CPU,
every model on CPUs without VNNI: runs_q8_0);
elsewhere its exact values are requantized to pagecli's int8 blocks of 64 (lossy: a second
rounding). The output layer (or the tied embedding table) runs on its Q8_0 blocks the same way,
where the file holds it so and the AVX2 kernel runs; otherwise it keeps the converted floats. Other
types keep the float weights of the converted folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagecli.errors import ModelError
from pagecli.models.gguf_files import AS_IS_TYPES, gguf_source, tensor_types

GROUP = 32  # weights per block in all three formats
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class Int4Parts:
    """One weight [N, K] in quantize_int4's layout: q uint8 [N, K] in [0, 15], scale and min fp16 [N, K / 32]."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


@dataclass(frozen=True)
class Q8Parts:
    """One Q8_0 weight [N, K]: q int8 [N, K] and scale fp16 [N, K / 32], w = q * scale."""

    q: torch.Tensor
    scale: torch.Tensor


def tensor_parts(tensor: Any) -> Int4Parts | Q8Parts | None:
    """A gguf ReaderTensor's blocks in pagecli's layout, rows in the file's order; None for other types."""
    kind = tensor.tensor_type.name
    if kind not in AS_IS_TYPES:
        return None
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    k = int(tensor.shape[0])
    groups = k // GROUP
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, groups, _BLOCK_BYTES[kind])  # [N, G, bytes]
    scale = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(rows, groups))
    if kind == "Q8_0":
        q8 = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, k)
        return Q8Parts(torch.from_numpy(q8.copy()), scale.clone())
    nibbles = blocks[:, :, 4:] if kind == "Q4_1" else blocks[:, :, 2:]  # [N, G, 16]: k i low, k i + 16 high
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).reshape(rows, k)  # [N, K]
    if kind == "Q4_1":
        minimum = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(rows, groups))
    else:
        minimum = (-8 * scale.float()).half()  # exact: a power-of-two multiple
        if not torch.isfinite(minimum).all():
            return None  # a scale past fp16's range / 8: keep the float path for this tensor
    return Int4Parts(torch.from_numpy(q.copy()), scale.clone(), minimum.clone())


def dequantize_parts(parts: Int4Parts | Q8Parts) -> torch.Tensor:
    """The float32 weights [N, K] the parts stand for, computed as the gguf package does."""
    if isinstance(parts, Q8Parts):
        return parts.q.float() * parts.scale.float().repeat_interleave(GROUP, dim=1)
    from pagecli.models.quantize_int4 import dequantize_int4

    return dequantize_int4(parts.q, parts.scale, parts.minimum)


def reorder_rows(parts: Int4Parts | Q8Parts, num_heads: int) -> Int4Parts | Q8Parts:
    """Undo llama.cpp's q/k row order (gguf_convert.unpermute_rotary_rows) on every part's rows."""
    from pagecli.models.gguf_convert import unpermute_rotary_rows

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_rotary_rows(t.numpy(), num_heads)))

    if isinstance(parts, Q8Parts):
        return Q8Parts(rows(parts.q), rows(parts.scale))
    return Int4Parts(rows(parts.q), rows(parts.scale), rows(parts.minimum))


def concat_parts(parts: list[Int4Parts | Q8Parts | None]) -> Int4Parts | Q8Parts | None:
    """The parts of a fused product (q/k/v, gate/up) stacked along N; None unless all are one kind."""
    if any(p is None for p in parts) or len({type(p) for p in parts}) != 1:
        return None
    if isinstance(parts[0], Q8Parts):
        return Q8Parts(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    return Int4Parts(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                     torch.cat([p.minimum for p in parts]))


# Each fused product of a decoder layer and the GGUF tensors it stacks, in order.
_PRODUCTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
}


class GgufBlocks:
    """A GGUF file's decoder products, read a layer at a time (the file opened once): layer(i) gives
    (submodule, product) -> Int4Parts / Q8Parts / None (float) for layer i's four fused products."""

    def __init__(self, gguf_path: Path, num_heads: int, num_kv_heads: int, folder: Path | None = None) -> None:
        from pagecli.models.gguf_index import read_tensors

        self.path = gguf_path
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.tensors = read_tensors(gguf_path, folder)  # through the converted folder's index where it has one

    def layer(self, index: int) -> dict[tuple[str, str], Any]:
        products: dict[tuple[str, str], Any] = {}
        for (module, product), names in _PRODUCTS.items():
            parts = []
            for name in names:
                tensor = self.tensors.get(f"blk.{index}.{name}.weight")
                if tensor is None:
                    raise ModelError(f"GGUF file '{self.path}' lacks blk.{index}.{name}.weight.")
                part = tensor_parts(tensor)
                if part is not None and name in ("attn_q", "attn_k"):
                    part = reorder_rows(part, self.num_heads if name == "attn_q" else self.num_kv_heads)
                parts.append(part)
            products[(module, product)] = concat_parts(parts)
        return products

    def output(self) -> Int4Parts | Q8Parts | None:
        """The output layer's blocks: output.weight, or the tied token_embd.weight where the file has no
        output tensor (None for other types)."""
        tensor = self.tensors.get("output.weight") or self.tensors.get("token_embd.weight")
        return tensor_parts(tensor) if tensor is not None else None


def auto_quantize(folder: Path, dtype: torch.dtype, ops: Any) -> str:
    """--quantize auto (the default): "gguf" for a model converted from a .gguf file whose decoder weights
    include Q4_0, Q4_1 or Q8_0 blocks, where it runs in float32 on pagecli.native (ops): there its blocks
    run as they lie on the kernels that round activations to int16 (runs_q8_0), the same numbers as the
    converted floats to 2^-16 of each activation block (KL 2e-7 on the embedded model) for a fifth of
    the bytes a decode step reads; "none" (the converted floats) everywhere else: bf16 and fp16 models,
    whose quantized products round activations to int8, the PyTorch path, GPUs, other files."""
    from pagecli.models.quantize import native_takes, uses_int16_activations

    if ops is None or not uses_int16_activations(dtype):
        return "none"
    if not (native_takes(ops.int8_linear_kind(), dtype) and native_takes(ops.int4_linear_kind(), dtype)):
        return "none"
    source = gguf_source(folder)
    if source is None:
        return "none"
    try:
        types = tensor_types(source, folder)
    except (ModelError, OSError, ValueError):  # changed since its conversion: the converted floats still load
        return "none"
    return "gguf" if any(kind in AS_IS_TYPES for kind in types) else "none"


def use_gguf_products(layer: Any, products: dict[tuple[str, str], Any], int4_ops: Any, int8_ops: Any,
                      int16_activations: bool = False) -> None:
    """Put a decoder layer's products on their GGUF blocks (GgufBlocks.layer): Int4Parts on the 4-bit
    kernel (int4_ops: pagecli.native, or None for the PyTorch reference), Q8Parts as they are on the
    int8 kernel where it rounds activations to int16 (use_q8_parts), else requantized to pagecli's int8
    blocks (int8_ops likewise), anything else left on the converted folder's floats.
    int16_activations: as Linear.quantize_int8."""
    for (module_name, product_name), parts in products.items():
        linear = getattr(getattr(layer, module_name), product_name)
        if isinstance(parts, Int4Parts):
            linear.use_int4(parts.q, parts.scale, parts.minimum, int4_ops, int16_activations)
        elif isinstance(parts, Q8Parts):
            use_q8_parts(linear, parts, int8_ops, int16_activations)


def runs_q8_0(int8_ops: Any, int16_activations: bool) -> bool:
    """Whether Q8_0 blocks run as they are: on the AVX2 int8 kernel, which float32 models get on every
    CPU (int16_activations) and every model on a CPU without VNNI; not the VNNI kernel or PyTorch."""
    return int8_ops is not None and (int16_activations or int8_ops.int8_linear_kind() == "avx2")


def use_q8_parts(linear: Any, parts: Q8Parts, int8_ops: Any, int16_activations: bool) -> None:
    """A Linear on a Q8_0 weight: its blocks as they are where the AVX2 int8 kernel runs it, else
    requantized to pagecli's int8 blocks of 64."""
    if runs_q8_0(int8_ops, int16_activations):
        linear.use_int8(parts.q, parts.scale, int8_ops, int16_activations=True)
        return
    linear.weight = torch.nn.Parameter(dequantize_parts(parts), requires_grad=False)
    linear.quantize_int8(int8_ops, int16_activations)
