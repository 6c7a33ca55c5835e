"""Per-SM limits of the NVIDIA targets pagecli compiles for, and the theoretical occupancy they allow.

Occupancy is the share of an SM's warp slots a kernel can keep resident, limited by whichever
runs out first: registers (allocated per warp in 256-register units), shared memory (plus the
1 KiB the driver reserves per block), warp slots, or the cap on resident blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIB = 1024
REGISTER_ALLOCATION_UNIT = 256  # registers are granted to a warp in multiples of this
RESERVED_SMEM_PER_BLOCK = 1 * KIB  # the driver's share of shared memory, per resident block
WARP_SIZE = 32


@dataclass(frozen=True)
class ArchLimits:
    """What one SM of a compute capability offers a kernel."""

    capability: int  # 80 = sm_80
    example_gpu: str
    smem_per_sm_bytes: int
    smem_per_block_bytes: int  # the opt-in maximum one block may use
    registers_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    max_registers_per_thread: int = 255


ARCHS: dict[int, ArchLimits] = {
    80: ArchLimits(80, "A100", 164 * KIB, 163 * KIB, 65536, 64, 32),
    86: ArchLimits(86, "RTX 3090 / A10", 100 * KIB, 99 * KIB, 65536, 48, 16),
    89: ArchLimits(89, "RTX 4090 / L4 / L40S", 100 * KIB, 99 * KIB, 65536, 48, 24),
    90: ArchLimits(90, "H100 / H200", 228 * KIB, 227 * KIB, 65536, 64, 32),
}


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # resident warps / the SM's warp slots
    limited_by: str  # "registers", "shared memory", "warps" or "blocks"


def theoretical_occupancy(arch: ArchLimits, registers_per_thread: int, smem_bytes: int, num_warps: int) -> Occupancy:
    """Resident blocks of num_warps warps on one SM of `arch`, and the share of warp slots they fill."""
    registers_per_warp = _round_up(max(registers_per_thread, 1) * WARP_SIZE, REGISTER_ALLOCATION_UNIT)
    limits = {  # on a tie the first is named: the SM's own caps before what the kernel could change
        "warps": arch.max_warps_per_sm // num_warps,
        "blocks": arch.max_blocks_per_sm,
        "registers": (arch.registers_per_sm // registers_per_warp) // num_warps,
        "shared memory": arch.smem_per_sm_bytes // (smem_bytes + RESERVED_SMEM_PER_BLOCK),
    }
    limited_by = min(limits, key=lambda name: limits[name])
    blocks = limits[limited_by]
    warps = blocks * num_warps
    return Occupancy(blocks, warps, warps / arch.max_warps_per_sm, limited_by)


def _round_up(value: int, unit: int) -> int:
    return math.ceil(value / unit) * unit
