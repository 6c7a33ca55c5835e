"""The memory's read bandwidth on this machine, by a plain read loop on every thread (the native
read_probe): the ceiling of single-stream decode, which reads every weight once per token. Decode
figures are given as a fraction of it (`python -m pagecli.native --bandwidth`, scripts/bench_gemm.py,
scripts/bench_shapes.py)."""

from __future__ import annotations

import time

import torch

from pagecli.native.interface import CpuOps

DEFAULT_MIB = 512  # well past any L3 cache, so that every pass comes from memory


def probe_buffer(mib: int = DEFAULT_MIB, ops: CpuOps | None = None) -> torch.Tensor:
    """A buffer of `mib` MiB whose pages are all written (a never-written page reads as the zero page,
    from cache, and would overstate the bandwidth); with `ops`, in the memory packed weights take
    (ops.weight_copy: 2 MB pages), so the loop reads as the products do."""
    values = torch.arange(mib * 2**20 // 8, dtype=torch.int64)
    return values if ops is None else ops.weight_copy(values)


def read_bandwidth(ops: CpuOps, repeats: int = 5, buffer: torch.Tensor | None = None) -> list[float]:
    """GB/s of each of `repeats` passes of ops.read_probe over the buffer (after one warm-up pass), on
    torch's intra-op threads."""
    buffer = probe_buffer(ops=ops) if buffer is None else buffer
    nbytes = buffer.numel() * buffer.element_size()
    ops.read_probe(buffer)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops.read_probe(buffer)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates
