"""The packed weights' memory (pagecli/native/weight_memory.h): zero-filled tensors in regions advised
for 2 MB pages, small ones sharing a region, each region unmapped with its last tensor; the pages are
huge where the kernel's transparent huge pages allow it; PAGECLI_HUGE_PAGES=0 falls back to torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from native_levels import ops, skip_without_native  # noqa: F401 - ops: the fixture, once per compiled level

skip_without_native()

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps entry holding `address`: its start, end and AnonHugePages (kB); None if unmapped."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {"start": start, "end": end} if start <= address < end else None
        elif entry is not None and line.startswith("AnonHugePages:"):
            entry["huge_kb"] = int(line.split()[1])
            return entry
    return entry


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float32])
@pytest.mark.parametrize("shape", [[3, 5], [48, 7, 2], [1 << 23]])
def test_weight_memory_is_zero_filled_and_contiguous(ops, dtype, shape):
    tensors = [ops.weight_zeros(shape, dtype) for _ in range(3)]
    for t in tensors:
        assert t.dtype == dtype and list(t.shape) == shape and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
        assert not t.any()
    tensors[0].fill_(1)  # small tensors share a region: no two overlap
    assert not tensors[1].any() and not tensors[2].any()


def test_a_large_tensor_gets_2mb_pages_and_its_region_goes_with_it(ops):
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off in this kernel")
    t = ops.weight_zeros([64 << 20], torch.uint8)
    t.fill_(7)
    address = t.data_ptr()
    assert address % (2 << 20) == 0
    entry = mapping_of(address)
    assert entry is not None and entry["huge_kb"] > 0, entry
    del t
    assert mapping_of(address) is None or mapping_of(address)["start"] != entry["start"]


def test_huge_pages_can_be_turned_off(ops, monkeypatch):
    monkeypatch.setenv("PAGECLI_HUGE_PAGES", "0")
    t = ops.weight_zeros([1 << 20], torch.uint8)
    assert not t.any()
