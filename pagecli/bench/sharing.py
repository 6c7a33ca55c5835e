"""Measured KV savings of block sharing: parallel sampling (n candidates) and beam search, run on a model.

After every engine step two counts are read from the stats snapshot: `blocks_active`, the physical blocks
the running sequences hold (a shared block once), and `block_references`, the blocks they would hold as
per-candidate copies (each sequence's whole block table: what an engine without sharing allocates). The
saving is 1 - (sum of active blocks over the steps) / (sum of references over the steps): the share of KV
memory that sharing saved, averaged over the run as the vLLM paper (section 6.3) reports it. Peaks are
reported too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pagecli.config import SamplingParams

SCENARIOS = ("parallel sampling", "beam search")


@dataclass(frozen=True)
class SharingFigures:
    scenario: str
    width: int  # n candidates, or beams
    prompts: int
    output_tokens: int  # max_tokens per sequence
    block_steps_shared: int  # sum over steps of physical blocks held
    block_steps_copies: int  # sum over steps of blocks per-candidate copies would hold
    peak_blocks_shared: int
    peak_blocks_copies: int

    @property
    def saved_share(self) -> float:
        return 1 - self.block_steps_shared / self.block_steps_copies if self.block_steps_copies else 0.0


def scenario_params(scenario: str, width: int, output_tokens: int) -> SamplingParams:
    if scenario == "parallel sampling":
        return SamplingParams(temperature=1.0, seed=0, max_tokens=output_tokens, ignore_eos=True, n=width)
    return SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True, beam_width=width, n=width)


def measure_sharing(engine: Any, prompts: Sequence[list[int]], scenario: str, width: int,
                    output_tokens: int) -> SharingFigures:
    """Run every prompt as one request of the scenario, all at once, and count blocks after each step."""
    params = scenario_params(scenario, width, output_tokens)
    for prompt in prompts:
        engine.add_request(prompt, params)
    shared = copies = peak_shared = peak_copies = 0
    while engine.has_unfinished:
        engine.step()
        stats = engine.stats()
        active = stats.blocks_active
        shared, copies = shared + active, copies + stats.block_references
        peak_shared, peak_copies = max(peak_shared, active), max(peak_copies, stats.block_references)
    return SharingFigures(scenario, width, len(prompts), output_tokens, shared, copies, peak_shared, peak_copies)


def sharing_prompts(engine: Any, lengths: Sequence[int], output_tokens: int) -> list[list[int]]:
    """Prompts of the given lengths in tokens (clipped so prompt and output fit the engine's context),
    cut from a fixed text so that every run sees the same tokens."""
    text = "Paged attention keeps the KV cache in fixed-size blocks, shared by reference count. "
    base = engine.encode(text)
    longest = max(1, engine.max_model_len - output_tokens - 1)
    prompts = []
    for i, length in enumerate(lengths):
        length = min(length, longest)
        ids = engine.encode(f"Request {i}: ") + base * (length // len(base) + 1)
        prompts.append(ids[:length])
    return prompts


def sharing_document(figures: SharingFigures) -> dict[str, Any]:
    """One scenario for `bench memory --json` (`forks[]` in docs/bench-json.md)."""
    return {**asdict(figures), "saved_share": round(figures.saved_share, 6)}
