"""How many KV blocks the engine allocates: the configured size, checked against the memory free
for it before a byte of the pool is taken.

The rule: the whole pool must fit in the memory available now, less a headroom.
- "Available now" is measured after the weights are loaded (they are copied out of the checkpoint,
  not mapped), so it no longer counts them: on a CPU, MemAvailable from /proc/meminfo (free pages
  plus the page cache the kernel can reclaim; elsewhere the free physical pages from os.sysconf),
  or less where a container's memory limit (cgroup v2 or v1) leaves less; on a GPU, the free bytes
  torch.cuda.mem_get_info reports.
- The headroom, 5% of that and at least 512 MiB, is for everything else a step needs: activations,
  logits, the tokenizer, the allocator's slack.
- The pool counts whole although the CPU pool is allocated lazily (untouched pages cost nothing):
  the prefix cache keeps finished prompts in their blocks and hands out never-used blocks before it
  evicts any, so a long run writes every block. A pool that only fits while it is empty is an
  out-of-memory kill later, in the middle of a request; here it is one sentence at start-up.
Where the available memory cannot be read, the configured size is taken as it is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagecli.config.settings import DEFAULT_KV_BUDGET_GIB, EngineConfig
from pagecli.errors import PagecliError

GIB = 1 << 30
_HEADROOM_SHARE = 0.05
_HEADROOM_MIN_BYTES = 512 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage, the memory.stat key of reclaimable file cache) for cgroup v2, then v1
_CGROUP_FILES = (("memory.max", "memory.current", "inactive_file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"))


@dataclass(frozen=True)
class FreeMemory:
    """Memory the KV pool may come from, as measured just before it is allocated."""

    available_bytes: int
    where: str  # "RAM", "free memory on cuda:0"

    @property
    def headroom_bytes(self) -> int:
        return max(_HEADROOM_MIN_BYTES, int(self.available_bytes * _HEADROOM_SHARE))

    @property
    def for_pool_bytes(self) -> int:
        return max(0, self.available_bytes - self.headroom_bytes)


def available_ram_bytes() -> int | None:
    """RAM the kernel can give this process now, or None where it cannot be read."""
    system = _system_available_bytes()
    container = cgroup_room_bytes()
    if system is None or container is None:
        return system if container is None else container
    return min(system, container)


def _system_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the figure is in KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def cgroup_room_bytes(root: Path = CGROUP_ROOT) -> int | None:
    """What this container's memory limit still allows (its usage less reclaimable file cache), or None
    without a limit. A limit of 2**60 bytes or more is cgroup v1's way of saying none."""
    for limit_name, usage_name, cache_key in _CGROUP_FILES:
        try:
            limit = int((root / limit_name).read_text())
            usage = int((root / usage_name).read_text())
        except (OSError, ValueError):  # no such cgroup version here, or v2's "max"
            continue
        if limit >= 1 << 60:
            return None
        stat_file = (root / limit_name).with_name("memory.stat")
        return max(0, limit - usage + _stat_value(stat_file, cache_key))
    return None


def _stat_value(stat_file: Path, key: str) -> int:
    try:
        for line in stat_file.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def free_memory(device: torch.device) -> FreeMemory | None:
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return FreeMemory(free_bytes, f"free memory on {device}")
    available = available_ram_bytes()
    return None if available is None else FreeMemory(available, "RAM")


def kv_budget_gib(config: EngineConfig, value_bytes: int = 2) -> float:
    """The CPU pool's budget: the configured one, else the default for a cache of `value_bytes`-byte values."""
    if config.kv_budget_gib is not None:
        return config.kv_budget_gib
    return DEFAULT_KV_BUDGET_GIB * max(1.0, value_bytes / 2)


def pool_num_blocks(config: EngineConfig, device: torch.device, kv_bytes_per_block: int, value_bytes: int = 2) -> int:
    """The number of KV blocks to allocate; PagecliError when none, or more than fit (see the rule).
    value_bytes: the bytes of one cached value (2 for bfloat16, 4 for float32, 1 for int8 or fp8)."""
    memory = free_memory(device)
    budget = kv_budget_gib(config, value_bytes)
    num_blocks = _configured_num_blocks(config, device, kv_bytes_per_block, memory, budget)
    if num_blocks < 1:
        raise PagecliError("The KV memory budget holds no block at all; raise kv_budget_gib or gpu_memory_fraction.")
    if memory is not None and num_blocks * kv_bytes_per_block > memory.for_pool_bytes:
        raise PagecliError(_does_not_fit(config, device, num_blocks * kv_bytes_per_block, kv_bytes_per_block, memory,
                                         budget))
    return num_blocks


def _configured_num_blocks(config: EngineConfig, device: torch.device, kv_bytes_per_block: int,
                           memory: FreeMemory | None, budget_gib: float) -> int:
    if config.num_blocks:
        return config.num_blocks
    if device.type == "cuda" and memory is not None:
        return int(memory.available_bytes * config.gpu_memory_fraction) // kv_bytes_per_block
    return int(budget_gib * GIB) // kv_bytes_per_block


def _does_not_fit(config: EngineConfig, device: torch.device, pool_bytes: int, kv_bytes_per_block: int,
                  memory: FreeMemory, budget_gib: float) -> str:
    if config.num_blocks:
        asked = f"num_blocks {config.num_blocks:,}"
        largest = f"at most {memory.for_pool_bytes // kv_bytes_per_block:,} blocks fit"
    elif device.type == "cuda":
        asked = f"gpu_memory_fraction {config.gpu_memory_fraction:g}"
        fraction = _round_down(memory.for_pool_bytes / memory.available_bytes)
        largest = f"the largest gpu_memory_fraction that fits is {fraction}"
    else:
        asked = f"{'the default ' if config.kv_budget_gib is None else ''}kv_budget_gib {budget_gib:g}"
        largest = f"the largest kv_budget_gib that fits is {_round_down(memory.for_pool_bytes / GIB)}"
    if memory.for_pool_bytes < kv_bytes_per_block:
        largest = "no KV pool fits; free some memory or use a smaller model"
    return (f"{asked} asks for a {_gib(pool_bytes)} KV pool, but only {_gib(memory.for_pool_bytes)} of {memory.where} "
            f"is free for it ({_gib(memory.available_bytes)} available, {_gib(memory.headroom_bytes)} kept for the "
            f"rest of pagecli); {largest}.")


def _round_down(value: float) -> str:
    """Two decimals, rounded down so the figure suggested really fits."""
    return f"{math.floor(value * 100) / 100:.2f}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"
