"""A GGUF file's Q4_0, Q4_1 and Q8_0 decoder weights read as they are (--quantize gguf), without the
float32 detour of gguf_convert, for weight_forms.py to hand to the decoder's Linears.

The block formats map onto pagecli's layouts: Q4_1 (32 weights: fp16 scale d, fp16 minimum m,
16 bytes of nibbles; w = q * d + m) is quantize_int4's layout itself; Q4_0 (fp16 d, nibbles,
w = (q - 8) * d) is the case m = -8 d (exact in fp16 and in the fp32 sum). Both then run on
pagecli.native's 4-bit kernel, the same bytes llama.cpp reads. Q8_0 (fp16 d, 32 int8; w = q * d)
runs as it is on the AVX2 int8 kernel (activations rounded to int16; float32 models on every CPU,
every model on CPUs without VNNI: weight_plan.WeightPlan.q8_0_as_is);
elsewhere its exact values are requantized to pagecli's int8 blocks of 64 (lossy: a second
rounding). The output layer (or the tied embedding table) runs on its Q8_0 blocks the same way,
where the file holds it so and the AVX2 kernel runs; otherwise it keeps the converted floats. Other
types keep the float weights of the converted folder. A mixture of experts' stacked expert tensors
([experts, out, in], each expert's blocks contiguous in the file) give each expert's gate/up and down products
their own slice of the blocks, so its experts run on the file's blocks as a dense MLP does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagecli.errors import ModelError
from pagecli.models.gguf_files import AS_IS_TYPES

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
    return stacked_parts([tensor])


def stacked_parts(tensors: list[Any], rotary_heads: list[int | None] | None = None) -> Int4Parts | Q8Parts | None:
    """The blocks of the tensors one fused product stacks along N (q/k/v, gate/up), decoded straight into one
    set of tensors: no part of its own to copy and concatenate. rotary_heads[i]: undo llama.cpp's q/k row
    order in tensor i for that many heads. None unless all are 4-bit (Q4_0/Q4_1) or all Q8_0, of one
    width, and every Q4_0 minimum fits fp16."""
    kinds = [tensor.tensor_type.name for tensor in tensors]
    widths = {int(tensor.shape[0]) for tensor in tensors}
    if any(kind not in AS_IS_TYPES for kind in kinds) or len({kind == "Q8_0" for kind in kinds}) != 1 or len(widths) != 1:
        return None
    k = widths.pop()
    blocks = [_raw_blocks(tensor, heads) for tensor, heads in zip(tensors, rotary_heads or [None] * len(tensors))]
    rows, groups = sum(b.shape[0] for b in blocks), k // GROUP
    int8 = kinds[0] == "Q8_0"
    q = torch.empty(rows, k, dtype=torch.int8 if int8 else torch.uint8)  # [N, K]
    scale = torch.empty(rows, groups, dtype=torch.float16)  # [N, K / 32]
    minimum = None if int8 else torch.empty(rows, groups, dtype=torch.float16)
    start = 0
    for kind, tensor_blocks in zip(kinds, blocks):
        end = start + tensor_blocks.shape[0]
        _decode(kind, tensor_blocks, q[start:end].numpy(), scale[start:end].numpy(),
                None if minimum is None else minimum[start:end].numpy())
        start = end
    if minimum is None:
        return Q8Parts(q, scale)
    if not torch.isfinite(minimum).all():
        return None  # a Q4_0 scale past fp16's range / 8: keep the float path for this product
    return Int4Parts(q, scale, minimum)


def _raw_blocks(tensor: Any, rotary_heads: int | None) -> np.ndarray:
    """The tensor's blocks, uint8 [N, K / 32, block bytes]: a view of the file's bytes, or a copy with
    llama.cpp's q/k row order undone (gguf_convert.unpermute_rotary_rows) for rotary_heads heads."""
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    groups = int(tensor.shape[0]) // GROUP
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, groups, _BLOCK_BYTES[tensor.tensor_type.name])
    if rotary_heads is None:
        return blocks
    from pagecli.models.gguf_convert import unpermute_rotary_rows

    return np.ascontiguousarray(unpermute_rotary_rows(blocks.reshape(rows, -1), rotary_heads)).reshape(blocks.shape)


def _decode(kind: str, blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None) -> None:
    """One tensor's blocks [N, G, bytes] into q [N, K], scale and minimum [N, G]: views of the stacked parts."""
    rows, groups, _ = blocks.shape
    scale[...] = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(rows, groups)
    q_groups = q.reshape(rows, groups, GROUP)  # [N, G, 32]
    if kind == "Q8_0":
        q_groups[...] = blocks[:, :, 2:].view(np.int8)
        return
    nibbles = blocks[:, :, 4:] if kind == "Q4_1" else blocks[:, :, 2:]  # [N, G, 16]: weight i low, i + 16 high
    np.bitwise_and(nibbles, 0x0F, out=q_groups[:, :, :16])
    np.right_shift(nibbles, 4, out=q_groups[:, :, 16:])
    if kind == "Q4_1":
        minimum[...] = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(rows, groups)
    else:
        with np.errstate(over="ignore"):  # past fp16's range: inf, and stacked_parts keeps the floats
            minimum[...] = (-8 * scale.astype(np.float32)).astype(np.float16)  # exact: a power-of-two multiple


def dequantize_parts(parts: Int4Parts | Q8Parts) -> torch.Tensor:
    """The float32 weights [N, K] the parts stand for, computed as the gguf package does."""
    if isinstance(parts, Q8Parts):  # in place over [N, G, 32], the scales broadcast
        n, k = parts.q.shape
        weights = parts.q.view(n, k // GROUP, GROUP).float()
        return weights.mul_(parts.scale.float().unsqueeze(2)).view(n, k)
    from pagecli.models.quantize_int4 import dequantize_int4

    return dequantize_int4(parts.q, parts.scale, parts.minimum)


# Each fused product of a decoder layer and the GGUF tensors it stacks, in order.
_PRODUCTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
}
# Phi-3's files hold q/k/v as one attn_qkv and gate/up as one ffn_up (gate's rows first), as its checkpoint does.
_FUSED_PRODUCTS = {
    ("self_attn", "qkv_proj"): ("attn_qkv",),
    ("mlp", "gate_up_proj"): ("ffn_up",),
}
# A mixture of experts' products, per expert (module mlp.experts.N), from the stacked expert tensors.
_EXPERT_PRODUCTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


# The model's Linears each fused product replaces (DecoderLayer.fuse_projections, GatedMLP's for an expert).
_CHECKPOINT_LINEARS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def weights_replaced(index: int, products: dict[tuple[str, str], Any],
                     fused_checkpoint: bool = False) -> frozenset[str]:
    """The model's weights of decoder layer `index` that its products on GGUF blocks (GgufBlocks.layer)
    replace: their converted floats need not be read. A bias stays: the products take it from the Linear.
    fused_checkpoint: the checkpoint holds qkv_proj and gate_up_proj themselves (Phi-3's, DecoderSpec's)."""
    return frozenset(f"model.layers.{index}.{module}.{linear}.weight"
                     for (module, product), parts in products.items() if parts is not None
                     for linear in ((product,) if fused_checkpoint else _CHECKPOINT_LINEARS[product]))


def expert_slice(tensor: Any, expert: int) -> Any:
    """One expert's [out, in] weight of a stacked expert tensor (GGUF shape [in, out, experts]): a view of its
    bytes, which lie contiguous, expert after expert."""
    num_experts = int(tensor.shape[2])
    expert_bytes = tensor.data.size // num_experts
    return replace(tensor, name=f"{tensor.name}[{expert}]", shape=tuple(tensor.shape[:2]),
                   data=tensor.data[expert * expert_bytes:(expert + 1) * expert_bytes])


class GgufBlocks:
    """A GGUF file's decoder products, read a layer at a time (the file opened once): layer(i) gives
    (submodule, product) -> Int4Parts / Q8Parts / None (float) for layer i's four fused products."""

    def __init__(self, gguf_path: Path, num_heads: int, num_kv_heads: int, folder: Path | None = None,
                 rows_permuted: bool = True) -> None:
        """rows_permuted: whether the file's q/k rows are in llama.cpp's rotary order (its llama models';
        gguf_convert.PERMUTED_ROTARY_ARCHITECTURES), to be undone."""
        from pagecli.models.gguf_index import map_file, read_tensors

        self.path = gguf_path
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.rows_permuted = rows_permuted
        self._mapping = map_file(gguf_path)
        # Through the converted folder's index where it has one; the bytes view self._mapping.
        self.tensors = read_tensors(gguf_path, folder, self._mapping)

    def layer(self, index: int) -> dict[tuple[str, str], Any]:
        """(submodule path in the decoder layer, product) -> its parts; a layer of experts has one gate/up and
        one down product per expert (mlp.experts.N)."""
        products: dict[tuple[str, str], Any] = {}
        rotary_heads = {"attn_q": self.num_heads, "attn_k": self.num_kv_heads} if self.rows_permuted else {}
        experts = f"blk.{index}.ffn_gate_exps.weight" in self.tensors
        for (module, product), names in self._products(index).items():
            if experts and module == "mlp":
                continue
            tensors = [self._tensor(index, name) for name in names]
            products[(module, product)] = stacked_parts(tensors, [rotary_heads.get(name) for name in names])
        if experts:
            for product, names in _EXPERT_PRODUCTS.items():
                stacked = [self._tensor(index, name) for name in names]
                for expert in range(int(stacked[0].shape[2])):
                    products[(f"mlp.experts.{expert}", product)] = stacked_parts(
                        [expert_slice(tensor, expert) for tensor in stacked])
        self._release_pages()
        return products

    def _products(self, index: int) -> dict[tuple[str, str], tuple[str, ...]]:
        """Layer `index`'s fused products and the GGUF tensors each stacks: Phi-3's fused tensors where the file
        has them (a product of one tensor), else the separate ones."""
        products = dict(_PRODUCTS)
        for key, (fused,) in _FUSED_PRODUCTS.items():
            separate = [name for name in _PRODUCTS[key] if name != fused]
            if f"blk.{index}.{fused}.weight" in self.tensors and not any(
                    f"blk.{index}.{name}.weight" in self.tensors for name in separate):
                products[key] = (fused,)
        return products

    def _tensor(self, index: int, name: str) -> Any:
        tensor = self.tensors.get(f"blk.{index}.{name}.weight")
        if tensor is None:
            raise ModelError(f"GGUF file '{self.path}' lacks blk.{index}.{name}.weight.")
        return tensor

    def _release_pages(self) -> None:
        """The parts are copies: the file's pages just read need not stay resident (100 MB of the embedded
        model's start peak; gguf_index.release_pages)."""
        from pagecli.models.gguf_index import release_pages

        release_pages(self._mapping)

    def output(self) -> Int4Parts | Q8Parts | None:
        """The output layer's blocks: output.weight, or the tied token_embd.weight where the file has no
        output tensor (None for other types)."""
        tensor = self.tensors.get("output.weight") or self.tensors.get("token_embd.weight")
        parts = tensor_parts(tensor) if tensor is not None else None
        self._release_pages()
        return parts
