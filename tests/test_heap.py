"""The engine keeps freed activation memory in the process (pagecli/engine/heap.py)."""

import resource

import pytest
import torch

from pagecli.engine.heap import keep_freed_activations


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_large_activation_allocated_again_faults_in_no_new_pages() -> None:
    if not keep_freed_activations():
        pytest.skip("the C library is not glibc")
    size = 96 << 20  # above glibc's largest mmap threshold of its own (32 MB)
    pages = size // 4096
    faults = []
    for _ in range(16):  # the heap grows for the first few, then the freed block is reused
        before = minor_faults()
        t = torch.empty(size, dtype=torch.uint8)
        t.fill_(1)
        del t
        faults.append(minor_faults() - before)
    assert max(faults[-4:]) < pages // 10, faults


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def test_memory_that_loading_freed_under_a_live_block_goes_back_to_the_system() -> None:
    # As when a model's row-layout weights are freed after packing while later blocks sit above them
    # in the heap: glibc trims only the heap's top by itself.
    from pagecli.engine.heap import return_freed_load_memory

    if not keep_freed_activations():  # also raises the trim threshold, as the engine does
        pytest.skip("the C library is not glibc")
    freed = [torch.ones(64 << 10, dtype=torch.uint8) for _ in range(2048)]  # 128 MB in heap blocks
    above = torch.ones(64 << 10, dtype=torch.uint8)  # a live block above them
    del freed
    before = resident_bytes()
    assert return_freed_load_memory()
    assert before - resident_bytes() > (64 << 20)
    assert int(above.sum()) == 64 << 10
