"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty, and the
grammar's mask for constrained rows (engine/structured.py; rows without a grammar pay nothing).

Each sampled sequence draws from its own torch.Generator, so the same seed gives the same
output whatever else shares the batch; the candidates of an n > 1 request each have their own.
"""

from __future__ import annotations

from collections.abc import Callable

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


def sample(logits: torch.Tensor, seqs: list[Sequence],
           greedy_tokens: Callable[[torch.Tensor], list[int]] | None = None) -> list[int]:
    """logits: [num_seqs, vocab] (any dtype, any device); returns one token id per sequence.
    greedy_tokens: the CPU kernels' argmax of each row (pagecli.native), else torch's."""
    logits = logits.cpu()
    # Plain greedy rows (the common case of a batch) take one argmax for all of them. max() gives
    # the same index (the first of equal maxima) and is about 4x faster than argmax() on bfloat16;
    # the native kernel gives that index again, in a few us where max() takes 50-180.
    constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    wanted = constrained or any(_plain_greedy(seq.sampling) for seq in seqs)
    if not wanted:
        chosen = [0] * len(seqs)
    elif greedy_tokens is not None:
        chosen = greedy_tokens(logits)
    else:
        chosen = logits.max(dim=-1).indices.tolist()
    if constrained:
        from pagecli.engine.structured import apply_grammar_masks

        # A plain greedy row whose argmax its grammar allows keeps it: only the others are masked.
        greedy = [chosen[row] if _plain_greedy(seqs[row].sampling) else None for row in constrained]
        masked = apply_grammar_masks(logits, constrained, [seqs[row].grammar for row in constrained], greedy)
        if masked:
            again = logits[torch.tensor(masked, dtype=torch.long)].max(dim=-1).indices.tolist()
            for row, token in zip(masked, again):
                chosen[row] = token
    by_temperature: dict[float, list[int]] = {}  # rows whose only reshaping is a temperature
    for row, seq in enumerate(seqs):
        params = seq.sampling
        if _plain_greedy(params):
            continue
        if _temperature_only(params):
            by_temperature.setdefault(params.temperature, []).append(row)
            continue
        row_logits = logits[row].float()
        if params.repetition_penalty != 1.0:
            row_logits = apply_repetition_penalty(row_logits, seq.token_ids, params.repetition_penalty)
        if params.greedy:
            chosen[row] = int(row_logits.argmax())
        else:
            chosen[row] = draw(filtered_probs(row_logits, params), seq.generator)
    for temperature, rows in by_temperature.items():
        # A softmax and a draw for 16 rows at a time (row by row, a 128-row step spent 20 of its 200 ms
        # here; the whole step at once allocates 25 MB of temporaries, which can fault in afresh at every
        # step). What a row gets is what it would get alone: the same arithmetic on each row.
        for first in range(0, len(rows), _ROWS_AT_ONCE):
            block = rows[first : first + _ROWS_AT_ONCE]
            scaled = logits[torch.tensor(block)].float()
            if temperature != 1.0:
                scaled.div_(temperature)
            probs = scaled.nan_to_num_(nan=float("-inf")).softmax(dim=-1)
            for row, token in zip(block, draw_rows(probs, [seqs[row].generator for row in block])):
                chosen[row] = token
    return chosen


_ROWS_AT_ONCE = 16


def _temperature_only(params: SamplingParams) -> bool:
    """Sampled with no filter but a temperature (the common sampled case), so rows batch."""
    return (not params.greedy and params.repetition_penalty == 1.0 and params.top_k == 0 and params.top_p == 1.0
            and params.min_p == 0.0)


_CHUNK = 256  # tokens a draw's second search runs over


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `probs` [rows, vocab] (each row a distribution, any scale), by the inverse of
    the row's cumulative distribution: the first token whose cumulative probability passes one uniform
    draw of the row's stream times the row's total, in float64. The search runs in two steps, over the
    sums of 256-token chunks and then within the chunk it lands in, so no row needs a cumulative sum over
    the whole vocabulary. A token of probability 0 is never chosen. One random number per token, where
    torch.multinomial draws one per vocabulary entry (1.1 ms a row for 49,152 entries)."""
    rows, vocab = probs.shape
    padded = torch.nn.functional.pad(probs, (0, -vocab % _CHUNK)) if vocab % _CHUNK else probs
    chunks = padded.reshape(rows, -1, _CHUNK)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [rows, chunks]
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    target = (u * chunk_cdf[:, -1]).unsqueeze(1)  # [rows, 1]
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_(max=chunk_cdf.shape[1] - 1)  # [rows, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    inside = chunks.gather(1, chunk.unsqueeze(2).expand(rows, 1, _CHUNK)).squeeze(1).double().cumsum(dim=-1)
    offset = torch.searchsorted(inside + before, target, right=True)
    picked = chunk * _CHUNK + offset  # [rows, 1]
    # Rounding at a chunk's end can pass every token of the chunk it landed in: take its last possible one.
    stray = (offset >= _CHUNK) | (picked >= vocab) | (probs.gather(1, picked.clamp(max=vocab - 1)) == 0)
    tokens = picked.squeeze(1).tolist()
    for row in stray.squeeze(1).nonzero().flatten().tolist():
        end = min(vocab, (int(chunk[row, 0]) + 1) * _CHUNK)
        possible = probs[row, :end].nonzero()
        tokens[row] = int(possible[-1]) if len(possible) else int(probs[row].nonzero()[-1])
    return tokens


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """draw_rows for one distribution `probs` [vocab]."""
    return draw_rows(probs.unsqueeze(0), [generator])[0]


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
