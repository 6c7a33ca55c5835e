"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty, and the
grammar's mask for constrained rows (engine/structured.py; rows without a grammar pay nothing).

Each sampled sequence draws from its own torch.Generator, so the same seed gives the same
output whatever else shares the batch; the candidates of an n > 1 request each have their own.
"""

from __future__ import annotations

import torch

from pagecli.config.settings import SamplingParams
from pagecli.engine.sequence import Sequence


def make_generator(sampling: SamplingParams, candidate_index: int = 0) -> torch.Generator | None:
    """The random stream of one sequence; candidate i of an n > 1 request seeds it with seed + i."""
    if sampling.greedy:
        return None
    generator = torch.Generator()
    seed = sampling.candidate_seed(candidate_index)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [num_seqs, vocab] (any dtype, any device); returns one token id per sequence."""
    logits = logits.cpu()
    # Plain greedy rows (the common case of a batch) take one argmax for all of them. max() gives
    # the same index (the first of equal maxima) and is about 4x faster than argmax() on bfloat16.
    chosen = logits.max(dim=-1).indices.tolist()
    constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if constrained:
        from pagecli.engine.structured import apply_grammar_masks

        # A plain greedy row whose argmax its grammar allows keeps it: only the others are masked.
        greedy = [chosen[row] if _plain_greedy(seqs[row].sampling) else None for row in constrained]
        masked = apply_grammar_masks(logits, constrained, [seqs[row].grammar for row in constrained], greedy)
        if masked:
            again = logits[torch.tensor(masked, dtype=torch.long)].max(dim=-1).indices.tolist()
            for row, token in zip(masked, again):
                chosen[row] = token
    for row, seq in enumerate(seqs):
        params = seq.sampling
        if _plain_greedy(params):
            continue
        row_logits = logits[row].float()
        if params.repetition_penalty != 1.0:
            row_logits = apply_repetition_penalty(row_logits, seq.token_ids, params.repetition_penalty)
        if params.greedy:
            chosen[row] = int(row_logits.argmax())
        else:
            chosen[row] = draw(filtered_probs(row_logits, params), seq.generator)
    return chosen


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` (a distribution over the vocabulary) by the inverse of its cumulative
    distribution: the first token whose cumulative probability passes one uniform draw of the sequence's
    stream (times the total, in float64). A token of probability 0 is never chosen. One random number per
    token, where torch.multinomial draws one per vocabulary entry: 0.11 against 1.1 ms for 49,152 entries."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if index >= probs.numel() or probs[index] == 0:  # u * total rounded up to the total
        index = int(probs.nonzero()[-1])
    return index


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that reshapes the logits first: the row's token is its argmax."""
    return params.greedy and params.repetition_penalty == 1.0


def skip_draw(seq: Sequence) -> None:
    """Move a sampled sequence's random stream as `sample` does for one token (`draw` takes one number
    whatever the probabilities), for a token appended without sampling (engine/structured.py's forced
    tokens): its later draws stay those of step-by-step decoding."""
    if seq.generator is not None:
        torch.rand((), generator=seq.generator, dtype=torch.float64)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    logits = logits.clone()
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (renormalised; never all zero)."""
    logits = (logits / params.temperature).nan_to_num(nan=float("-inf"))
    top = logits.max()
    if torch.isinf(top):  # an absurd repetition penalty overflowed: take the limit, not NaN
        logits = torch.where(logits == top, 0.0, float("-inf")) if top > 0 else torch.zeros_like(logits)
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        drop_sorted = (cumulative - sorted_probs) >= params.top_p  # keeps the token that crosses top_p
        drop_sorted[0] = False  # and the most likely one, even when top_p rounds to 0 in float32
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()
