"""Keep the memory of freed activations in the process for the next step (glibc's malloc, Linux).

A prefill step of a few thousand tokens allocates tensors of 50-130 MB per layer (the MLP's gate and
up output for 4,096 tokens of a 2,048-wide model with an 8,192-wide MLP is 134 MB). glibc serves
every block above 32 MB with a fresh mmap and unmaps it on free, so each step faults in, and the
kernel zeroes, every page again: about 30 ms per 134 MB on a 2-core Zen 4 (tests/test_heap.py
counts the faults; docs/benchmarks/cpu-without-amx.md has the step times). Once the weights and the
KV pool are in place, the engine raises malloc's mmap and trim thresholds so those blocks come from
the heap and stay there for the next step. The process then keeps its peak activation memory, which
each step needs again, instead of returning it to the system between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # return the heap's free top to the system only past 2 GiB


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (and mallopt's parameters, malloc_trim)
    except (OSError, AttributeError):
        return None
    return libc


@functools.lru_cache(maxsize=1)
def keep_freed_activations() -> bool:
    """Raise glibc's thresholds once per process; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def return_freed_load_memory() -> bool:
    """Give the system back the heap pages that loading freed: the row-layout weights a model read
    before its products were packed into memory of their own (pagecli/native/weight_memory.h), which
    glibc otherwise keeps wherever later blocks sit above them (140 MB of the embedded model's 590 MB).
    False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)  # 1 if it returned any memory, 0 if there was none to return
    return True
