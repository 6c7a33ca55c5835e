"""Weight quantization at load (--quantize int8): symmetric int8 with one scale per output channel,
and the PyTorch reference product every native int8 kernel is tested against.

w[n, k] ~= q[n, k] * scale[n], scale[n] = max_k |w[n, k]| / 127, q = round(w / scale) in [-127, 127];
a product sums x[m, k] * q[n, k] in fp32, then multiplies by scale[n] and adds the bias. Only the
decoder layers' Linears are quantized: the embedding table (and the output layer, which may share it)
keeps the model's dtype, since the lookup needs its exact rows.

On AVX512-VNNI the native kernel also rounds the activations to int8 per row and block of 64
(int8_blocks_reference below is that arithmetic): at SmolLM2-1.7B's shapes and 512 rows it runs at
759-780 GFLOP/s against 433-442 for the packed bf16 GEMM and 376-396 for the earlier int8 kernel,
which widened the weights to bf16 (Zen 4, 2 threads, scripts/bench_quant_products.py, 2026-11-26).
On the AVX2 level the int8 kernel is slower than bf16 (48 against 72 tok/s decode, 143 against 602
batched, SmolLM2-135M on Zen 4, 2026-11-25): there it only saves memory.
"""

from __future__ import annotations

import torch

from pagecli.errors import PagecliError


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N] float32)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # [N]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0, any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that q and scale stand for."""
    return q.float() * scale[:, None]


class Int8Reference:
    """The int8 product in PyTorch: the native kernels' arithmetic (fp32 sums, then scale and bias),
    used where no kernel runs it (PAGECLI_CPU_ISA=torch, or a level whose kernel does not take the
    model's dtype)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale = q, scale
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() @ self.q.float().T) * self.scale  # [..., N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


ACTIVATION_BLOCK = 64  # the AVX512-VNNI kernel rounds activations to int8 in blocks of this many k
TINY_BLOCK = float(torch.tensor(1e-30, dtype=torch.float32))  # a block whose largest |x| is below it counts as zero


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the AVX512-VNNI products do to their activations (act_quant.h): x [..., K] -> (xq [M, B, 64]
    float64 holding integers in [-127, 127], zero past K; d [M, B, 1] float64), M rows, B blocks of 64:
    d = max |x| / 127 and xq = round(x * (127 / max |x|)) per block, a block whose max |x| is below
    1e-30 zeros."""
    K = x.shape[-1]
    blocks = -(-K // ACTIVATION_BLOCK)
    xf = torch.nn.functional.pad(x.float().reshape(-1, K), (0, blocks * ACTIVATION_BLOCK - K))
    xb = xf.view(-1, blocks, ACTIVATION_BLOCK)  # [M, B, 64]
    amax = xb.abs().amax(dim=-1, keepdim=True)  # [M, B, 1]
    amax = torch.where(amax >= TINY_BLOCK, amax, torch.zeros_like(amax))  # a block below it rounds to zeros
    # 127 / amax correctly rounded, as the kernel divides (`127 / tensor` would multiply by a reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).clamp_(-127, 127).double()  # [M, B, 64]
    return xq, (amax / 127).double()


def int8_blocks_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The AVX512-VNNI int8 kernel's arithmetic in PyTorch (float64 sums; the kernel's fp32 ones
    differ only by rounding): x rounded as round_activations does, each block's integer products
    times d, summed, times the channel's scale, plus the bias. x [..., K] -> [..., N] float32."""
    xq, d = round_activations(x)
    blocks = xq.shape[1]
    wq = torch.nn.functional.pad(q.double(), (0, blocks * ACTIVATION_BLOCK - q.shape[1])).view(q.shape[0], blocks, -1)
    sums = torch.einsum("mbk,nbk->mbn", xq, wq)  # exact integers
    y = (sums * d).sum(dim=1) * scale.double()  # [M, N]
    if bias is not None:
        y = y + bias.double()
    return y.float().view(*x.shape[:-1], q.shape[0])


def native_takes(kind: str, dtype: torch.dtype) -> bool:
    """Whether a native quantized kernel of this kind (ops.int8_linear_kind() or int4_linear_kind())
    takes activations of this dtype: the AVX2 and AVX512-VNNI ones take float32, bf16 and fp16
    (float32 ones on the AVX2 kernel, which VNNI builds carry too: keeps_float_activations)."""
    return kind in ("avx2", "avx512_vnni") and dtype in (torch.float32, torch.bfloat16, torch.float16)


def keeps_float_activations(dtype: torch.dtype) -> bool:
    """Whether the native quantized products keep a model's activations float: float32 models do, so
    their products are float32 math on the dequantized weights (the same numbers as the converted
    float32 model, up to the order of the sums), at the AVX2 kernels' speed. bf16 and fp16 models
    round activations to int8 per 64-block on a VNNI CPU, several times faster for prompts (the loss
    is in docs/benchmarks/cpu-without-amx.md)."""
    return dtype == torch.float32


def check_quantize_device(quantize: str, device: torch.device) -> None:
    if quantize != "none" and device.type != "cpu":
        raise PagecliError(f"--quantize {quantize} runs on the CPU only; use --device cpu or --quantize none.")
