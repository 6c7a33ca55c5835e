"""On the compiled CPU levels, a prompt's logits and its greedy continuation are the same bits however
the prompt reaches the model: whole, in chunks of any budget, or as the rest of it after a prefix hit.
(PyTorch's flash kernel, which ran prompts without a prefill kernel of pagecli's own before, splits its
sums by the lengths it is given: the same prompt's logits then differed in their last bits after a
hit, enough to change a greedy choice at a near-tie.) Speculative decoding's checking step is held to
plain decoding in tests/test_speculation.py."""

from __future__ import annotations

import pytest
import torch

from architecture_helpers import at_level, engine_for  # noqa: F401  (at_level is a fixture)
from native_levels import COMPILED_LEVELS, skip_without_native, threads
from pagecli.config import SamplingParams

skip_without_native()

PROMPT = ("Paged attention keeps the KV cache in fixed-size blocks, shared by reference count. "
          "A prefix hit skips the blocks a prompt shares with one seen before. ") * 3
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def logits_of(engine, prompt: str) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """Every sampled row's logits, step by step, and the tokens chosen."""
    rows: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(scheduled, greedy=False):
        logits, choices = execute(scheduled, greedy)
        if logits.shape[0]:
            rows.append(logits.clone())
        return logits, choices

    engine.runner.execute = recording
    try:
        out = engine.generate([prompt], GREEDY)[0]
    finally:
        engine.runner.execute = execute
    return rows, out.token_ids


# Float32 models' products are F32PanelLinear's on every level: PyTorch's float32 GEMM, which the avx512 and amx
# levels used until 2026-12-02, sums a few rows (the one-call decode step's short chunks) otherwise than many
# (the layer loop's whole prompt): chunks of 5 gave logits 9e-8 away (with PAGECLI_BF16_WEIGHTS=0 they still do).
@pytest.mark.parametrize("level", COMPILED_LEVELS)
def test_whole_chunked_and_after_a_prefix_hit_give_the_same_bits(level, at_level, tiny_model_factory):  # noqa: F811
    at_level(level)
    folder = tiny_model_factory("llama")
    with threads(1):
        engine = engine_for(folder, attention="auto", block_size=16)
        whole, tokens = logits_of(engine, PROMPT)
        assert len(whole) == GREEDY.max_tokens
        hit, hit_tokens = logits_of(engine, PROMPT)  # the same prompt again: its full blocks are found
        assert engine.stats().prefix_hit_tokens > 0, "the second run was meant to find the prompt's blocks"
        runs = {"after a prefix hit": hit}
        for budget in (5, 16, 40):  # short chunks (the one-call decode step), and chunks of the layer loop
            chunked = engine_for(folder, attention="auto", block_size=16, max_num_batched_tokens=budget,
                                 enable_prefix_caching=False)
            runs[f"chunks of {budget}"], chunk_tokens = logits_of(chunked, PROMPT)
            assert chunk_tokens == tokens
    assert hit_tokens == tokens
    for name, rows in runs.items():
        assert len(rows) == len(whole), name
        for step, (a, b) in enumerate(zip(whole, rows)):
            assert torch.equal(a, b), f"{name}: step {step} differs by {(a - b).abs().max().item():.3g}"
