"""The read bandwidth's probe (pagecli/native/read_probe.cpp, pagecli/native/bandwidth.py): it reads every
byte once, whichever thread takes which part, at every compiled level, and `python -m pagecli.native
--bandwidth` prints the figure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagecli.native.bandwidth import probe_buffer, read_bandwidth

from native_levels import ops, skip_without_native, threads  # noqa: F401 - ops: the fixture, once per compiled level

skip_without_native()


def xor_of_words(buffer: torch.Tensor) -> int:
    words = buffer.contiguous().view(torch.uint8).numpy().view(np.uint64)
    return int(np.bitwise_xor.reduce(words).astype(np.int64)) if words.size else 0


# Line counts: one, a partial 256 KB unit, whole units plus a tail (so both threads' shares and the
# 4-line unrolled loop's remainder are read), and none.
@pytest.mark.parametrize("lines", [1, 3, 4097, 3 * 4096 + 5, 0])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_probe_reads_every_word_once(ops, lines, count):
    gen = torch.Generator().manual_seed(lines)
    buffer = torch.randint(-2**62, 2**62, (lines * 8,), dtype=torch.int64, generator=gen)
    with threads(count):
        assert ops.read_probe(buffer) == xor_of_words(buffer)


def test_the_probe_refuses_a_partial_line(ops):
    with pytest.raises(RuntimeError, match="whole 64-byte lines"):
        ops.read_probe(torch.zeros(9, dtype=torch.int64))


def test_read_bandwidth_gives_a_figure_a_pass(ops):
    rates = read_bandwidth(ops, repeats=3, buffer=probe_buffer(8))
    assert len(rates) == 3 and all(rate > 0 for rate in rates)
    assert int(probe_buffer(1)[-1]) == 2**20 // 8 - 1  # every page written


def test_the_module_prints_the_bandwidth(capsys):
    from pagecli.native.__main__ import main

    assert main(["--bandwidth"]) == 0
    assert "read bandwidth, " in capsys.readouterr().out
    assert main(["--nonsense"]) == 2
