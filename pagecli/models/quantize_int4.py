"""4-bit weights (--quantize int4, and GGUF Q4_0/Q4_1 tensors run as they are): groups of 32 weights
along the input dimension, each with an fp16 scale and an fp16 minimum, and the PyTorch reference
product every native int4 kernel is tested against.

w[n, k] = q[n, k] * scale[n, g] + min[n, g], g = k // 32, q in [0, 15] (the Q4_1 layout; Q4_0 is
min = -8 * scale). Quantizing a group: min = its smallest weight and scale = (largest - smallest) / 15,
both rounded to fp16 first, then q = round((w - min) / scale): every weight within half a step of
what it stands for (plus the fp16 rounding of min). Only the decoder layers' Linears are 4-bit; the
output layer goes to int8 and the embedding table keeps the model's dtype (weight_forms.py).

On AVX512-VNNI the native kernel rounds the activations to int8 per row and block of 64, as the int8
product does (int4_blocks_reference below is that arithmetic): at SmolLM2-1.7B's shapes and 512 rows
598-632 GFLOP/s against about 300 for the earlier kernel (bf16 activations, nibbles widened to bf16)
and 434-449 for the packed bf16 GEMM (Zen 4, 2 threads, scripts/bench_quant_products.py, 2026-11-26).
"""

from __future__ import annotations

from typing import Any

import torch

from pagecli.models.quantize import INT8_LEVELS, in_row_chunks, round_activations
from pagecli.native.interface import CpuOps

GROUP = 32  # weights per group along K (pagecli/native/quant_int4.h: kInt4Group)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] uint8 in [0, 15], scale [N, G] fp16, min [N, G] fp16), G = ceil(K / 32)."""
    return in_row_chunks(weight, _quantize_int4_rows)


def _quantize_int4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    groups = -(-k // GROUP)
    w = weight.detach().to(torch.float32, copy=True)  # worked on in place below
    if groups * GROUP != k:  # the tail group repeats its last weight: its min and max stay its own
        w = torch.nn.functional.pad(w, (0, groups * GROUP - k), mode="replicate")
    w = w.view(n, groups, GROUP)
    low, high = torch.aminmax(w, dim=2)  # [N, G]
    minimum = low.half()
    scale = ((high - minimum.float()) / 15).half()
    step = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))  # a flat group: q = 0
    q = w.sub_(minimum.float()[..., None]).div_(step[..., None]).round_().clamp_(0, 15)
    return q.view(n, groups * GROUP)[:, :k].to(torch.uint8).contiguous(), scale, minimum


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that q, scale and min stand for (q * scale, then + min, as gguf does)."""
    n, k = q.shape
    if k % GROUP == 0:  # in place over [N, G, 32], the scales broadcast: the same floats, no [N, K] copies of them
        weights = q.view(n, k // GROUP, GROUP).float()
        weights.mul_(scale.float().unsqueeze(2)).add_(minimum.float().unsqueeze(2))
        return weights.view(n, k)
    expand = lambda t: t.float().repeat_interleave(GROUP, dim=1)[:, :k]  # noqa: E731 - [N, G] -> [N, K]
    return q.float() * expand(scale) + expand(minimum)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 -> [N, ceil(K / 2)] uint8, two weights a byte (k even in the low nibble)."""
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack_nibbles undone: [N, ceil(K / 2)] -> q [N, K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=2).view(packed.shape[0], -1)[:, :k]


class Int4Reference:
    """The int4 product in PyTorch: x @ dequantize_int4(...)^T in float32 (+ bias), where no kernel runs
    it (PAGECLI_CPU_ISA=torch, or a level whose kernel does not take the model's dtype). Keeps the
    weights two to a byte and dequantizes them for every call: the reference, not a fast path."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weights = pack_nibbles(q)  # [N, ceil(K / 2)]
        self.scale, self.minimum = scale, minimum
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_int4(unpack_nibbles(self.weights, self.in_features), self.scale, self.minimum)  # [N, K]
        y = x.float() @ w.T  # [..., N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def int4_blocks_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                          bias: torch.Tensor | None, levels: int = INT8_LEVELS) -> torch.Tensor:
    """The native int4 kernels' arithmetic in PyTorch (float64 sums; the kernels' fp32 ones differ
    only by rounding): x rounded as quantize.round_activations(x, levels) does (127: AVX512-VNNI,
    32767: AVX2, 32639: AVX512-VNNI for a float32 model, quantize.KIND_LEVELS); per group of 32,
    y += d * (scale * sum(xq * q) + min * sum(xq)) with d the row's scale for the group's 64-block;
    plus the bias. x [..., K], q [N, K] in [0, 15], scale and min [N, ceil(K / 32)] -> [..., N] float32."""
    xq, d = round_activations(x, levels)  # [M, B, 64], [M, B, 1]
    groups = scale.shape[1]
    xg = xq.reshape(xq.shape[0], -1, GROUP)[:, :groups]  # [M, G, 32]
    dg = d.repeat_interleave(2, dim=1)[:, :groups]  # [M, G, 1]
    wq = torch.nn.functional.pad(q.double(), (0, groups * GROUP - q.shape[1])).view(q.shape[0], groups, GROUP)
    isum = torch.einsum("mgk,ngk->mgn", xg, wq)  # [M, G, N] exact integers
    xs = xg.sum(-1, keepdim=True)  # [M, G, 1]
    y = (dg * (isum * scale.double().T + xs * minimum.double().T)).sum(dim=1)  # [M, N]
    if bias is not None:
        y = y + bias.double()
    return y.float().view(*x.shape[:-1], q.shape[0])


def int4_product(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None, ops: CpuOps | None,
                 int16_activations: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The product that runs 4-bit weights (q [N, K] in [0, 15], fp16 scale and min [N, ceil(K / 32)]: quantized
    here, or a GGUF file's Q4_0/Q4_1 blocks): pagecli.native's PackedLinearInt4 when ops is given
    (int16_activations as for quantize.int8_product), else Int4Reference; with the tensors it reads, by
    the parameter names its Linear keeps them under."""
    if ops is None:
        product = Int4Reference(q, scale, minimum, bias)
        return product, {"packed_weight": product.weights, "weight_scale": scale, "weight_min": minimum}
    product = ops.PackedLinearInt4(q, scale, minimum, bias, int16_activations=int16_activations)
    kept = {"packed_weight": product.weights}
    if product.scales.numel():  # AVX2 keeps them beside the rows: count their bytes too
        kept["weight_scale"] = product.scales
    return product, kept
