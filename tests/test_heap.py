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
