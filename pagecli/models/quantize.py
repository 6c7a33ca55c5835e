"""Weight quantization at load (--quantize int8): symmetric int8 with one scale per output channel and
block of 64 along the input, and the PyTorch reference product every native int8 kernel is tested
against.

w[n, k] ~= q[n, k] * scale[n, b] with b = k // 64, scale[n, b] = max |w[n, block b]| / 127 rounded
to bf16, q = round(w / scale) in [-127, 127]; a product sums x[m, k] * q[n, k] per block in fp32,
multiplies each block's sum by its scale, adds the blocks in order, then the bias. The decoder
layers' Linears and the output layer are quantized; the embedding table keeps the model's dtype,
since the lookup needs its exact rows (a tied table is kept for the lookup beside the output
layer's int8 copy: weight_forms.py).

Why blocks: one scale per output channel (what the quantization issue asked for first) cost SmolLM2-135M
1.07% perplexity on tests/data/declaration.txt in float32 (26.3530 -> 26.6361), nearly all of it
from the weights (rounding activations too moved it to +1.18%); one scale per 64-block gave 26.1766,
within the text's noise of float32 (docs/benchmarks/cpu-without-amx.md). A bf16 scale per 64 int8
weights adds 3% to the bytes read, against Q8_0's 6% (an fp16 scale per 32). The blocks line up
with the VNNI kernel's activation blocks, so each block's exact integer sum takes one scale product.

On AVX512-VNNI the native kernel also rounds the activations to int8 per row and block of 64
(int8_blocks_reference below is that arithmetic): at SmolLM2-1.7B's shapes and 512 rows the per-channel
kernel ran at 759-780 GFLOP/s against 433-442 for the packed bf16 GEMM (Zen 4, 2 threads,
scripts/bench_quant_products.py, 2026-11-26). On the AVX2 level (and for float32 models) the
activations are rounded to int16 per 64-block instead (int8_blocks_reference with levels=32767),
256 times finer, and multiplied with vpmaddwd (panel_i16.h).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagecli.native.interface import CpuOps

WEIGHT_BLOCK = 64  # int8 weights: one scale per output channel and this many k
INT8_FORMAT = "int8-b64"  # what the disk store's fingerprint calls these weights (per-channel int8 was "int8")


CHUNK_ELEMENTS = 1 << 24  # weights quantized at once: float32 temporaries of 64 MB each, whatever the tensor


def in_row_chunks(weight: torch.Tensor, quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
                  ) -> tuple[torch.Tensor, ...]:
    """quantize_rows over weight [N, K] a few rows at a time, the parts joined: the same tensors as in one
    call (every row is quantized alone), without float32 copies of the whole weight (an output layer
    of 201M weights took about 3 GB of temporaries at once)."""
    rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= rows:
        return quantize_rows(weight)
    parts = [quantize_rows(weight[start : start + rows]) for start in range(0, weight.shape[0], rows)]
    return tuple(torch.cat(tensors) for tensors in zip(*parts))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N, ceil(K / 64)] bfloat16)."""
    return in_row_chunks(weight, _quantize_int8_rows)


def _quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = weight.shape
    blocks = -(-K // WEIGHT_BLOCK)
    w = weight.detach().to(torch.float32, copy=True)  # worked on in place below
    if blocks * WEIGHT_BLOCK != K:
        w = torch.nn.functional.pad(w, (0, blocks * WEIGHT_BLOCK - K))  # zeros never raise a block's max |w|
    wb = w.view(N, blocks, WEIGHT_BLOCK)
    low, high = torch.aminmax(wb, dim=2)  # max |w| = max(high, -low): one pass, no |w| copy
    scale = (torch.maximum(high, low.neg()) / 127).to(torch.bfloat16)  # [N, B]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: q = 0, any scale
    q = wb.div_(scale.float()[:, :, None]).round_().clamp_(-127, 127).to(torch.int8)  # [N, B, 64]
    return q.view(N, -1)[:, :K].contiguous(), scale


def block_scales(scale: torch.Tensor, K: int) -> torch.Tensor:
    """scale [N, B] -> float32 [N, K]: each k's block scale."""
    return scale.float().repeat_interleave(WEIGHT_BLOCK, dim=1)[:, :K]


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that q and scale stand for."""
    return q.float() * block_scales(scale, q.shape[1])


class Int8Reference:
    """The int8 product in PyTorch: float32 math on the dequantized weights, plus the bias; used where
    no kernel runs it (PAGECLI_CPU_ISA=torch, or a level whose kernel does not take the model's dtype)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale = q, scale
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ dequantize_int8(self.q, self.scale).T  # [..., N]; the floats live for this call only
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def int8_product(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, ops: CpuOps | None,
                 int16_activations: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The product that runs int8 weights q [N, K] with their scales: pagecli.native's PackedLinearInt8
    when ops is given (int16_activations: it rounds activations to int16 per 64 instead of int8 where the
    CPU has VNNI; bf16 scales per 64, or a GGUF Q8_0 tensor's fp16 ones per 32, which only its AVX2
    kernel takes), else Int8Reference (bf16 scales per 64); with the tensors the product reads, by the
    parameter names its Linear keeps them under (so they count as the model's bytes)."""
    if ops is None:
        return Int8Reference(q, scale, bias), {"packed_weight": q, "weight_scale": scale}
    product = ops.PackedLinearInt8(q, scale, bias, int16_activations=int16_activations)
    return product, {"packed_weight": product.weights, "weight_scale": product.scales}


ACTIVATION_BLOCK = 64  # the AVX512-VNNI kernel rounds activations to int8 in blocks of this many k (= WEIGHT_BLOCK)
TINY_BLOCK = float(torch.tensor(1e-30, dtype=torch.float32))  # a block whose largest |x| is below it counts as zero


INT8_LEVELS = 127  # the AVX512-VNNI kernels round activations to int8 (act_quant.h)
INT16_LEVELS = 32767  # the AVX2 ones to int16 (panel_i16.h)
WIDE_LEVELS = 32639  # the VNNI int4 kernel's wide tiles to int16 kept as two int8 halves (act_quant.h's WideRows)
# A native quantized product's kind (its `kind`) -> the levels it rounds activations to.
KIND_LEVELS = {"avx512_vnni": INT8_LEVELS, "avx2": INT16_LEVELS, "avx512_vnni_i16": WIDE_LEVELS}


def activation_levels(kind: str) -> int:
    """The levels a native quantized product of this kind rounds its activations to (KIND_LEVELS)."""
    return KIND_LEVELS[kind]


def round_activations(x: torch.Tensor, levels: int = INT8_LEVELS) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native quantized products do to their activations (act_quant.h's int8 with levels
    127, panel_i16.h's int16 with 32767, the VNNI int4 kernel's wide tiles with 32639): x [..., K] ->
    (xq [M, B, 64] float64 holding integers in [-levels, levels], zero past K; d [M, B, 1] float64),
    M rows, B blocks of 64: d = max |x| / levels
    and xq = round(x * (levels / max |x|)) per block, a block whose max |x| is below 1e-30 zeros."""
    K = x.shape[-1]
    blocks = -(-K // ACTIVATION_BLOCK)
    xf = torch.nn.functional.pad(x.float().reshape(-1, K), (0, blocks * ACTIVATION_BLOCK - K))
    xb = xf.view(-1, blocks, ACTIVATION_BLOCK)  # [M, B, 64]
    amax = xb.abs().amax(dim=-1, keepdim=True)  # [M, B, 1]
    amax = torch.where(amax >= TINY_BLOCK, amax, torch.zeros_like(amax))  # a block below it rounds to zeros
    # levels / amax correctly rounded, as the kernel divides (`levels / tensor` would multiply by a reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, float(levels)) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).clamp_(-levels, levels).double()  # [M, B, 64]
    return xq, (amax / levels).double()


def int8_blocks_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, levels: int = INT8_LEVELS) -> torch.Tensor:
    """The native int8 kernels' arithmetic in PyTorch (float64 sums; the kernels' fp32 ones differ
    only by rounding): x rounded as round_activations(x, levels) does (127: AVX512-VNNI, 32767:
    AVX2), each block's integer products times d and the block's weight scale, summed, plus the
    bias. x [..., K] -> [..., N] float32."""
    xq, d = round_activations(x, levels)
    blocks = xq.shape[1]
    wq = torch.nn.functional.pad(q.double(), (0, blocks * ACTIVATION_BLOCK - q.shape[1])).view(q.shape[0], blocks, -1)
    sums = torch.einsum("mbk,nbk->mbn", xq, wq)  # exact integers
    y = (sums * d * scale.double().T[None]).sum(dim=1)  # [M, N]
    if bias is not None:
        y = y + bias.double()
    return y.float().view(*x.shape[:-1], q.shape[0])
