"""Attention backends over the paged KV cache, and the choice between them.

`triton` runs our kernels (pagecli.kernels) on CUDA; `torch` runs everywhere: pagecli's compiled CPU
kernels where they are built (cpu_backend.py), else PyTorch (reference_backend.py).
Both read and write the same NHD cache layout: [num_blocks, block_size, kv_heads, head_dim].
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from pagecli.attention.metadata import AttentionMetadata
from pagecli.errors import PagecliError
from pagecli.native.interface import CpuOps

ATTENTION_CHOICES = ("auto", "triton", "torch")


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def copy_blocks(self, kv_caches: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """kv_caches: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]; block dst[i] gets src[i]."""
        ...

    def forward(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float, softcap: float | None = None, window: int | None = None,
    ) -> torch.Tensor:
        """softcap: scores -> softcap * tanh(scores / softcap); window: each query attends to its last
        `window` positions only (None: all); every backend applies both."""
        ...


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def select_backend(name: str, device: torch.device, cpu_ops: CpuOps | None = None) -> AttentionBackend:
    """Resolve --attention auto|triton|torch for a device; triton needs CUDA unless interpreting.
    cpu_ops (pagecli.native): `torch` on the CPU runs them (CpuAttentionBackend), else PyTorch alone."""
    if name not in ATTENTION_CHOICES:
        raise PagecliError(f"Unknown attention backend '{name}'; choose one of: {', '.join(ATTENTION_CHOICES)}.")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if cpu_ops is not None and device.type == "cpu":
            from pagecli.attention.cpu_backend import CpuAttentionBackend

            return CpuAttentionBackend(cpu_ops)
        from pagecli.attention.reference_backend import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    if device.type != "cuda" and not triton_interpreting():
        raise PagecliError(
            "The triton attention backend needs an NVIDIA GPU (or TRITON_INTERPRET=1 for testing); "
            "use --attention torch on this machine."
        )
    try:
        from pagecli.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:  # triton missing from the environment
        raise PagecliError(f"The triton attention backend is unavailable ({exc}); use --attention torch.") from exc
    return TritonAttentionBackend()


__all__ = ["ATTENTION_CHOICES", "AttentionBackend", "AttentionMetadata", "select_backend", "triton_interpreting"]
