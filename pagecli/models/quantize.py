"""Weight quantization at load (--quantize int8): symmetric int8 with one scale per output channel,
and the PyTorch reference product every native int8 kernel is tested against.

w[n, k] ~= q[n, k] * scale[n], scale[n] = max_k |w[n, k]| / 127, q = round(w / scale) in [-127, 127];
a product sums x[m, k] * q[n, k] in fp32, then multiplies by scale[n] and adds the bias. Only the
decoder layers' Linears are quantized: the embedding table (and the output layer, which may share it)
keeps the model's dtype, since the lookup needs its exact rows.

Measured (SmolLM2-135M, Zen 4, 2 threads, scripts/bench_packed_ab.py, 2026-11-25): on AVX512-BF16 int8
decodes one stream at 207-254 tok/s against 119-182 for packed bf16, and batches a little slower
(1110-1165 against 1246-1318 tok/s); on the AVX2 level its kernel is slower than bf16 (48 against 72
tok/s decode, 143 against 602 batched): there it only saves memory.
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
    used where no kernel runs it (PAGECLI_CPU_ISA=torch, float32 models on AVX512-BF16)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale = q, scale
        self.bias = None if bias is None else bias.detach().float()
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() @ self.q.float().T) * self.scale  # [..., N]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def check_quantize_device(quantize: str, device: torch.device) -> None:
    if quantize != "none" and device.type != "cpu":
        raise PagecliError(f"--quantize {quantize} runs on the CPU only; use --device cpu or --quantize none.")
