"""Choosing the next token of every sampled row of a step at once, from its logits.

The filters, in this order (each keeps a set of tokens; the drawn token's probability is its weight,
renormalised over what every filter kept; the drawn distribution is exactly that one):

1. penalties on the logits: `repetition_penalty` (CTRL's: every token seen so far, prompt included, has
   a positive logit divided by it and a negative one multiplied), `presence_penalty` and
   `frequency_penalty` (OpenAI's: subtracted from the logit of each token generated so far, once and
   once per occurrence), `logit_bias` (added to the named tokens' logits);
2. the grammar's mask (structured output): the tokens it forbids get -inf;
3. temperature: weights e = exp((logit - top logit) / temperature); temperature 0 is greedy, the first
   token of the largest logit after 1 and 2;
4. top_k: the k tokens of largest logit (all of those tied with the k-th), the same as the k heaviest
   but where rounding gives two logits one weight;
5. top_p: of those, the tokens whose heavier tokens hold less than top_p of the kept weight (the
   smallest set that reaches top_p, all of those tied at its edge);
6. min_p: of those, the tokens of weight at least min_p times the top token's.

Logits on the CPU with pagecli's kernels go to `sample_rows` (native/sampling.cpp: no sort of the
vocabulary; top-p by rejection against pivots); elsewhere (a GPU, or no kernels) `sample_rows_torch`
(engine/sampler_torch.py) makes the kernel's sets and draws with tensor operations on the logits'
device. Each sampled sequence has its own random stream (`RandomStream`): the same seed gives the same
tokens whatever else shares the batch, and on the CPU kernel and the tensor path alike; the candidates
of an n > 1 request each have their own.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence as SequenceOf

import torch

from pagecli.config.settings import SamplingParams
from pagecli.engine.sampler_torch import sample_rows_tensor, sample_rows_torch
from pagecli.engine.sequence import Sequence
from pagecli.native.interface import CpuOps

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class RandomStream:
    """A sequence's random numbers: word i is splitmix64 of (seed + i * golden ratio); cheap, seeded, and
    the same on every machine. The CPU kernel derives a row's uniform numbers from its word."""

    __slots__ = ("seed", "drawn")

    def __init__(self, seed: int) -> None:
        self.seed = seed & _MASK64
        self.drawn = 0

    def next_word(self) -> int:
        self.drawn += 1
        z = (self.seed + self.drawn * _GOLDEN) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)


def make_random(sampling: SamplingParams, candidate_index: int = 0) -> RandomStream | None:
    """The random stream of one sequence; candidate i of an n > 1 request seeds it with seed + i."""
    if sampling.greedy:
        return None
    seed = sampling.candidate_seed(candidate_index)
    return RandomStream(secrets.randbits(64) if seed is None else seed)


def skip_draw(seq: Sequence) -> None:
    """Move a sampled sequence's random stream as `sample` does for one token (one word per token), for a
    token appended without sampling (engine/structured.py's forced tokens): its later draws stay those
    of step-by-step decoding."""
    if seq.rng is not None:
        seq.rng.next_word()


def sample(logits: torch.Tensor, seqs: SequenceOf[Sequence], ops: CpuOps | None = None,
           greedy_choices: torch.Tensor | None = None) -> list[int]:
    """logits: [num_seqs, vocab] (any dtype, any device); one token id per sequence, -1 for a constrained one
    whose grammar left no token. ops: pagecli's CPU kernels (pagecli.native), which take CPU rows; without
    them, tensor operations on the logits' device. greedy_choices: int64 [num_seqs], each row's first index of
    its largest logit as the output layer took it (ModelRunner.execute), in place of a pass over the logits."""
    constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if constrained:
        logits = logits.cpu()  # the grammar's masks are built on the CPU
    penalised = [row for row, seq in enumerate(seqs) if _penalised(seq.sampling)]
    if penalised:
        logits = logits.to(torch.float32, copy=True)  # [num_seqs, vocab]
        for row in penalised:
            apply_penalties(logits[row], seqs[row])
        greedy_choices = None  # not these logits' choices any more
    sampled = [row for row, seq in enumerate(seqs) if not seq.sampling.greedy]
    if not constrained and (ops is None or logits.device.type != "cpu"):
        return _sample_on_device(logits, seqs, sampled)
    chosen = _greedy_choices(logits, seqs, constrained, ops, greedy_choices)
    if sampled:
        rows = logits if len(sampled) == len(seqs) else logits[torch.tensor(sampled, device=logits.device)]
        params = [seqs[row].sampling for row in sampled]
        words = [seqs[row].rng.next_word() for row in sampled]
        if ops is not None and rows.device.type == "cpu":
            drawn = ops.sample_rows(rows, [p.temperature for p in params], [p.top_k for p in params],
                                    [p.top_p for p in params], [p.min_p for p in params], words)
        else:  # constrained rows without the CPU kernels
            drawn = sample_rows_torch(rows, params, words)
        for row, token in zip(sampled, drawn):
            # -1: nothing drawable. A constrained row keeps it (its grammar left no token: the engine ends
            # that request alone); any other row (every logit NaN or -inf) takes its argmax.
            unconstrained_dead_end = token < 0 and seqs[row].grammar is None
            chosen[row] = int(logits[row].float().max(dim=-1).indices) if unconstrained_dead_end else token
    return chosen


def _sample_on_device(logits: torch.Tensor, seqs: SequenceOf[Sequence], sampled: list[int]) -> list[int]:
    """Every row's token with tensor operations on the logits' device (no grammar in the batch), and one
    copy of the tokens to the host: the argmax of every row, the sampled rows' draws put over theirs."""
    chosen = logits.max(dim=-1).indices  # [rows]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        rows = logits if len(sampled) == len(seqs) else logits.index_select(0, index)
        params = [seqs[row].sampling for row in sampled]
        drawn = sample_rows_tensor(rows, params, [seqs[row].rng.next_word() for row in sampled])
        greedy = chosen.index_select(0, index)
        # -1: nothing drawable (every logit NaN or -inf, no grammar): the row's argmax, as on the CPU.
        chosen = chosen.index_copy(0, index, torch.where(drawn < 0, greedy, drawn))
    return chosen.tolist()


def _greedy_choices(logits: torch.Tensor, seqs: SequenceOf[Sequence], constrained: list[int], ops: CpuOps | None,
                    taken: torch.Tensor | None = None) -> list[int]:
    """The greedy rows' tokens (every row's argmax, taken once for the batch, or `taken` where the output layer
    took them), after their grammar masks (-1 where a mask left no token); masks the sampled rows' logits in
    place too. Sampled rows get a placeholder."""
    wanted = constrained or any(seq.sampling.greedy for seq in seqs)
    if not wanted:
        return [0] * len(seqs)
    if taken is not None and taken.shape[0] == logits.shape[0]:
        chosen = taken.tolist()
    # The native kernel gives torch.max's index (the first of equal maxima) in a few us where max()
    # takes 50-180; max() is about 4x faster than argmax() on bfloat16.
    elif ops is not None and logits.device.type == "cpu":
        chosen = ops.greedy_tokens(logits)
    else:
        chosen = logits.max(dim=-1).indices.tolist()
    if constrained:
        from pagecli.engine.structured import apply_grammar_masks

        # A greedy row whose argmax its grammar allows keeps it: only the others are masked.
        greedy = [chosen[row] if seqs[row].sampling.greedy else None for row in constrained]
        masked = apply_grammar_masks(logits, constrained, [seqs[row].grammar for row in constrained], greedy)
        if masked:
            best = logits[torch.tensor(masked, dtype=torch.long)].max(dim=-1)
            for row, value, token in zip(masked, best.values.tolist(), best.indices.tolist()):
                chosen[row] = token if value > float("-inf") else -1  # -1: the grammar left no token
    return chosen


def _penalised(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.logit_bias))


def apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """Filter 1 on one row of float32 logits [vocab], in place: repetition, presence and frequency
    penalties over seq's tokens, then the logit bias."""
    params = seq.sampling
    if params.repetition_penalty != 1.0:
        row.copy_(apply_repetition_penalty(row, seq.token_ids, params.repetition_penalty))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = Counter(seq.token_ids[seq.num_prompt_tokens:])
        if counts:
            ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
            times = torch.tensor(list(counts.values()), dtype=torch.float32, device=row.device)
            row.index_add_(0, ids, -(params.presence_penalty + params.frequency_penalty * times))
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long, device=row.device)
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=torch.float32, device=row.device)
        row.index_add_(0, ids, bias)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=logits.device)
    logits = logits.clone()
    values = logits[seen]
    logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return logits
