"""For tests that run once per compiled CPU kernel level this machine executes (avx512, avx2, and amx
where the CPU has it; PAGECLI_CPU_ISA's levels): the levels, and a module-scoped `ops` fixture that
gives each level's kernels. A test module imports `ops` from here (`from native_levels import ops`)
after skipping itself where PAGECLI_NATIVE=0 turns the compiled kernels off (`skip_without_native()`);
`threads(count)` runs a block on that many of torch's threads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pagecli import native
from pagecli.native import isa


def skip_without_native() -> None:
    if not native.enabled():
        pytest.skip("PAGECLI_NATIVE=0 turns the compiled kernels off", allow_module_level=True)


COMPILED_LEVELS = [level for level in isa.machine_levels(native.cpu_flags()) if level != "torch"]


@pytest.fixture(scope="module", params=COMPILED_LEVELS)
def ops(request):
    return native.cpu_ops_for(request.param)


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        if torch.get_num_threads() != count:
            pytest.skip(f"this build of torch does not run {count} threads")
        yield
    finally:
        torch.set_num_threads(before)
