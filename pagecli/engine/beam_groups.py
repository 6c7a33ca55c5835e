"""Beam search requests in the engine: each beam is a sequence, and beams share blocks with their parents.

A beam search request starts as one sequence. Each time every live beam of the request has its next-token
log-probs (its "row"), the request's BeamScorer (engine/beam.py) picks the next beams, each a parent beam
plus one token, and the beams are re-forked from their parents:

- a parent's first child is the parent's own sequence, with the token appended (it keeps its blocks);
- each further child is a fork that takes references to every block of the parent (share_blocks); the
  first write into the shared partial last block copies it (copy-on-write, as for n > 1 candidates);
- a parent with no child is finished: its references go back, so the blocks only it held are freed
  and the blocks its siblings share lose one reference.

Beams do not need to be computed in the same step: a beam whose row is in waits (its sequence stays
running with nothing left to compute; the scheduler skips it) until its siblings' rows are in. A preempted
beam keeps its row; a beam forked from a preempted parent starts in the waiting queue, with no blocks, and
is recomputed (prefix cache hits for the full blocks), so preemption never changes a beam's tokens.

When the search ends, the request's n best hypotheses become its completions, best first (`index` is the
rank), each with transformers' sequence score. Beams stream no text while they run: a beam's history can
change at every step, so only the final hypotheses are text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagecli.engine.beam import BeamScorer, Hypothesis
from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.scheduler import Scheduler
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.errors import RequestError


@dataclass(frozen=True)
class FinishedBeam:
    """One returned hypothesis of a finished beam search, with what its completion reports."""

    request_id: str
    rank: int  # 0 = best
    hypothesis: Hypothesis
    finish_reason: str
    first: Sequence  # the request's first sequence: prompt, timings, cached tokens


@dataclass(eq=False)  # compared by identity
class _Group:
    scorer: BeamScorer
    first: Sequence
    beams: list[Sequence]  # live beams by slot (one before the first step)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> [vocab] float32 log-probs
    next_index: int = 1  # candidate_index of the next forked beam (unique within the request)


class BeamGroups:
    """The beam search requests of one engine; `take_rows` runs after each forward pass."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, stop_token_ids: frozenset[int]) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.stop_token_ids = stop_token_ids
        self._groups: dict[str, _Group] = {}
        self.tokens_chosen = 0  # tokens appended to beams, over all searches

    def start(self, seq: Sequence) -> None:
        """Make seq, a new request's only sequence, the first beam of a beam search; RequestError if the
        engine could not hold all its beams at once."""
        params = seq.sampling
        self._refuse_unholdable(seq)
        stops = frozenset() if params.ignore_eos else self.stop_token_ids
        max_new = min(params.max_tokens, seq.max_model_len - seq.num_prompt_tokens)
        scorer = BeamScorer(params.beam_width, max_new, stops, params.length_penalty, params.early_stopping)
        seq.forked = True  # a beam search never forks as n > 1 candidates do
        self._groups[seq.request_id] = _Group(scorer, seq, [seq])

    def _refuse_unholdable(self, seq: Sequence) -> None:
        width, seats = seq.sampling.beam_width, self.scheduler.max_num_seqs
        if width > seats:
            raise RequestError(f"beam_width {width} is more than max_num_seqs {seats}; "
                               "lower beam_width or raise max_num_seqs.")
        pool = self.kv.pool
        needed = beam_blocks_needed(seq.sampling, seq.num_prompt_tokens, seq.max_model_len, pool.block_size)
        if needed > pool.num_blocks:
            raise RequestError(f"beam search with beam_width {width} may need {needed} KV blocks at once; the pool "
                               f"has {pool.num_blocks}. Lower beam_width or max_tokens, or raise the KV budget.")

    def owns(self, seq: Sequence) -> bool:
        return seq.request_id in self._groups

    def drop(self, request_id: str) -> None:
        """Forget an aborted request (the scheduler has finished its sequences)."""
        self._groups.pop(request_id, None)

    def take_rows(self, sampled: list[Sequence], logits: torch.Tensor
                  ) -> tuple[list[Sequence], torch.Tensor, list[FinishedBeam]]:
        """Keep the rows of beam sequences and step every group whose rows are all in. Returns the other
        sequences with their logits rows, and the hypotheses of the searches that ended."""
        if not self._groups:
            return sampled, logits, []
        mine = [row for row, seq in enumerate(sampled) if self.owns(seq)]
        if not mine:
            return sampled, logits, []
        others = [row for row, seq in enumerate(sampled) if not self.owns(seq)]
        log_probs = torch.log_softmax(logits[mine].float(), dim=-1).cpu()  # [len(mine), vocab], as transformers
        stepped: list[_Group] = []
        for i, row in enumerate(mine):
            group = self._groups[sampled[row].request_id]
            slot = next(s for s, beam in enumerate(group.beams) if beam is sampled[row])
            group.rows.setdefault(slot, log_probs[i])  # a recomputed beam keeps its first row
            if len(group.rows) == len(group.beams) and group not in stepped:
                stepped.append(group)
        finished = [hyp for group in stepped for hyp in self._advance(group)]
        rest = logits[torch.tensor(others, dtype=torch.long, device=logits.device)]  # [len(others), vocab]
        return [sampled[row] for row in others], rest, finished

    def _advance(self, group: _Group) -> list[FinishedBeam]:
        """One beam step: the scorer picks the next beams; re-fork them, or end the search."""
        rows = torch.stack([group.rows[slot] for slot in range(len(group.beams))])  # [beams, vocab]
        group.rows.clear()
        choices = group.scorer.step(rows)
        if not choices:
            return self._finish(group)
        group.beams = self._refork(group, choices)
        return []

    def _refork(self, group: _Group, choices: list[tuple[int, int]]) -> list[Sequence]:
        """The next beams, by slot, from (parent slot, token) choices; parents without a child are finished."""
        children: dict[int, list[int]] = {}
        for slot, (parent, _) in enumerate(choices):
            children.setdefault(parent, []).append(slot)
        beams: list[Sequence | None] = [None] * len(choices)
        for parent_slot, slots in children.items():
            parent = group.beams[parent_slot]
            forks = [self._fork(group, parent) for _ in slots[1:]]
            self._place(parent, forks)
            for slot, beam in zip(slots, [parent, *forks]):
                beam.append_token(choices[slot][1])
                self.tokens_chosen += 1
                beams[slot] = beam
        for parent_slot, parent in enumerate(group.beams):
            if parent_slot not in children:
                self._end(parent, "beam_dropped")
        return beams  # type: ignore[return-value]

    def _fork(self, group: _Group, parent: Sequence) -> Sequence:
        child = parent.fork(group.next_index, None)
        group.next_index += 1
        self.kv.share_blocks(parent, child)
        return child

    def _place(self, parent: Sequence, forks: list[Sequence]) -> None:
        """Forks run right after their parent: in `running` if it holds blocks, else waiting behind it."""
        if not forks:
            return
        if parent.status is SequenceStatus.RUNNING:
            self.scheduler.add_forked(parent, forks)
            return
        waiting = self.scheduler.waiting
        at = waiting.index(parent) + 1
        for offset, fork in enumerate(forks):
            fork.status = SequenceStatus.WAITING
            waiting.insert(at + offset, fork)

    def _end(self, seq: Sequence, reason: str) -> None:
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self.scheduler.finish(seq, reason)

    def _finish(self, group: _Group) -> list[FinishedBeam]:
        for beam in group.beams:
            self._end(beam, "beam_done")
        del self._groups[group.first.request_id]
        best = group.scorer.best(group.first.sampling.n)
        stops = group.scorer.stop_token_ids.tolist()
        return [FinishedBeam(group.first.request_id, rank, hyp, "stop" if hyp.token_ids[-1] in stops else "length",
                             group.first) for rank, hyp in enumerate(best)]


def beam_blocks_needed(params: Any, prompt_tokens: int, max_model_len: int, block_size: int) -> int:
    """Blocks a beam search may hold at once if nothing were shared: every beam resident with its own copy
    of prompt and output. The pool must hold that many, or a beam could wait forever for blocks that its
    parked siblings hold."""
    longest = min(prompt_tokens + params.max_tokens, max_model_len)
    return params.beam_width * -(-longest // block_size)
