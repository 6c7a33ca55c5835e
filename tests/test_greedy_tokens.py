"""The CPU kernels' greedy choice (pagecli/native/greedy.cpp): each row's first index of its largest
logit, the index torch.max(dim=-1) gives, at every compiled level, for every logits dtype, with ties,
NaNs and rows that masking left at -inf; and the sampler takes it for plain greedy rows."""

from __future__ import annotations

import pytest
import torch

from native_levels import ops, skip_without_native  # noqa: F401 - ops: the fixture, once per compiled level

skip_without_native()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 32003])
def test_the_greedy_token_is_torch_max_index(ops, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype)
    if vocab > 16:
        # Ties: the largest value again after the first one, in and past the first vector of 16.
        top = logits[2].max()
        logits[2, 3] = top
        logits[2, vocab - 1] = top
        logits[3, :] = -float("inf")  # every token masked
        logits[4, 7] = float("nan")
    assert ops.greedy_tokens(logits) == logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_and_nans_across_the_kernels_chunks_of_1024_logits(ops, dtype):
    """The kernel takes a row in chunks of 1,024 logits in one pass: the first chunk holding the largest value,
    then its first index there. Equal maxima in several chunks, at chunk edges, a NaN after the maximum."""
    vocab = 5000
    logits = torch.zeros(8, vocab).to(dtype)
    logits[0, [1023, 1024, 4999]] = 3  # the first of three equal maxima ends the first chunk
    logits[1, [1024, 2048]] = 3  # the first one starts the second chunk
    logits[2, [4999]] = 3  # in the short last chunk
    logits[3, [2500, 100]] = torch.tensor([5.0, 4.0]).to(dtype)  # a larger value in a later chunk wins
    logits[4, 4000] = float("nan")  # a NaN after the maximum: torch.max's NaN
    logits[4, 10] = 9
    logits[5, :] = -float("inf")
    logits[5, 3000:] = -1  # all but the first chunks masked
    logits[6, :] = -float("inf")
    logits[7, [2047, 3071]] = 1  # two equal maxima, each at the end of its chunk
    assert ops.greedy_tokens(logits) == logits.max(dim=-1).indices.tolist() == [1023, 1024, 4999, 2500, 4000, 3000, 0, 2047]


def test_a_strided_view_of_logits_is_read_as_its_values(ops):
    logits = torch.randn(6, 100).bfloat16()
    view = logits[::2, 10:90]
    assert ops.greedy_tokens(view) == view.max(dim=-1).indices.tolist()


def test_the_sampler_takes_the_kernel_for_plain_greedy_rows(ops):
    from types import SimpleNamespace

    from pagecli.config import SamplingParams
    from pagecli.engine.sampler import sample

    calls = []

    def kernel(logits):
        calls.append(logits.shape)
        return ops.greedy_tokens(logits)

    seqs = [SimpleNamespace(sampling=SamplingParams(temperature=0), grammar=None, rng=None) for _ in range(3)]
    logits = torch.randn(3, 300).bfloat16()
    kernels = SimpleNamespace(greedy_tokens=kernel, sample_rows=ops.sample_rows)
    assert sample(logits, seqs, kernels) == sample(logits, seqs) == logits.max(dim=-1).indices.tolist()
    assert calls == [torch.Size([3, 300])]
