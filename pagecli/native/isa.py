"""CPU instruction-set levels: which the CPU runs, which one this process uses, how each is compiled.

Levels, highest first: `amx` (Intel Xeon from Sapphire Rapids: AMX tiles and AVX-512 BF16),
`avx512` (AVX-512 F/BW/VL, with BF16 and VNNI where the CPU has them: AMD Zen 4/5, Intel Ice Lake
and later), `avx2` (AVX2 + FMA: most laptops and desktops), `torch` (no compiled kernels: PyTorch's
own ops, the reference every level is tested against). A process uses the highest level its CPU
runs unless PAGECLI_CPU_ISA names a lower one, so every level can be tested and measured on one
machine.
"""

from __future__ import annotations

import os

from pagecli.errors import PagecliError

LEVELS = ("amx", "avx512", "avx2", "torch")
ENV_VAR = "PAGECLI_CPU_ISA"

# Compiler flags per level. `amx` and `avx512` build for this very CPU (-march=native); `avx512`
# turns AMX off, so on an AMX machine it is what a Zen 4 or Ice Lake runs. `avx2` builds for the
# x86-64-v3 baseline (AVX2, FMA, F16C), tuned for this CPU: no AVX-512 code is compiled in.
LEVEL_CFLAGS = {
    "amx": ["-march=native"],
    "avx512": ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
}

_NEEDS = {
    "amx": {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl"},
    "avx512": {"avx512f", "avx512bw", "avx512vl"},
    "avx2": {"avx2", "fma", "f16c"},
    "torch": set(),
}


def machine_levels(cpu_flags: str) -> tuple[str, ...]:
    """The levels a CPU with these /proc/cpuinfo flags runs, highest first (`torch` always)."""
    flags = set(cpu_flags.split())
    return tuple(level for level in LEVELS if _NEEDS[level] <= flags)


def chosen_level(cpu_flags: str) -> str:
    """PAGECLI_CPU_ISA when set (it may only lower the level), else the highest the CPU runs."""
    available = machine_levels(cpu_flags)
    wanted = os.environ.get(ENV_VAR, "").strip().lower()
    if not wanted or wanted == "auto":
        return available[0]
    if wanted not in LEVELS:
        raise PagecliError(f"{ENV_VAR}={wanted} is not a level; use one of {', '.join(LEVELS)} (or auto).")
    if wanted not in available:
        raise PagecliError(f"{ENV_VAR}={wanted}, but this CPU cannot run that level; it runs "
                           f"{', '.join(available)}.")
    return wanted


# What PyTorch's own libraries may use at each forced level, so that a forced level measures what a
# CPU of that kind runs, oneDNN's and MKL's products included (they pick their code at run time).
_LIBRARY_LIMITS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def limit_libraries() -> None:
    """When PAGECLI_CPU_ISA forces avx512 or avx2, cap oneDNN and MKL at that level too (unless the
    user set their variables). Must run before torch first multiplies: both read them once."""
    wanted = os.environ.get(ENV_VAR, "").strip().lower()
    for name, value in _LIBRARY_LIMITS.get(wanted, {}).items():
        os.environ.setdefault(name, value)
