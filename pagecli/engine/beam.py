"""Beam search scoring for one request: which beams go on, which hypotheses are finished, when to stop.

`BeamScorer` knows tokens and log-probabilities only, never blocks or sequences (engine/beam_groups.py
turns its choices into forked sequences). It follows transformers' beam search (GenerationMixin._beam_search,
transformers 5.x) step for step, in float32, so the same log-probabilities give the same beams and scores:

- each step, every running beam's log-softmax row plus the beam's cumulative log-prob is one candidate per
  token; the top `(1 + number of stop tokens) * width` candidates are kept, so that at least `width` of them
  do not end, whatever the stop tokens do;
- the best `width` candidates that do not end become the next running beams;
- a candidate among the best `width` that ends (a stop token, or max_tokens reached) is a finished
  hypothesis, scored `sum_logprobs / generated_len ** length_penalty` (generated_len counts the stop
  token); the `width` best finished hypotheses are kept;
- the search stops when every candidate ends (max_tokens), when early_stopping is True and `width`
  hypotheses finished, or when no running beam can beat the worst kept hypothesis: its score is bounded by
  the best running beam's log-prob over the current generated length (early_stopping False), or over
  max_tokens when early_stopping is "never" and length_penalty > 0.

Scores stay float32 tensors with transformers' -1e9 sentinels (a slot with no finished hypothesis yet, a
candidate that cannot be taken), so ties and rounding go the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NOT_A_CHOICE = -1.0e9  # transformers' sentinel score: below any real log-prob sum, above -inf


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (stop token included) and transformers' sequence score."""

    token_ids: tuple[int, ...]
    score: float


class BeamScorer:
    """The state of one beam search: running beams (generated tokens, cumulative log-probs) and the kept
    finished hypotheses. `step` takes the running beams' log-prob rows and says who goes on."""

    def __init__(self, width: int, max_new_tokens: int, stop_token_ids: frozenset[int], length_penalty: float = 1.0,
                 early_stopping: bool | str = False) -> None:
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.candidates_per_step = max(2, 1 + len(stop_token_ids)) * width
        # Running beams: slot 0 starts alone; the other slots' -1e9 keeps the first step to slot 0's row.
        self.running: list[tuple[int, ...]] = [()] * width
        self.running_scores = torch.full((width,), _NOT_A_CHOICE, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.finished: list[tuple[int, ...]] = [()] * width
        self.finished_scores = torch.full((width,), _NOT_A_CHOICE, dtype=torch.float32)
        self.is_finished = torch.zeros(width, dtype=torch.bool)
        self.can_improve = True  # transformers' is_early_stop_heuristic_unsatisfied: sticky once False
        self.done = False

    @property
    def generated_len(self) -> int:
        """Tokens every running beam has generated so far (they all have the same length)."""
        return len(self.running[0])

    def step(self, log_probs: torch.Tensor) -> list[tuple[int, int]]:
        """log_probs: [width, vocab] float32 log-softmax rows of the running beams, by slot (the first step:
        [1, vocab], the prompt's row, which every slot shares). Returns the next running beams as
        (parent slot, token) by slot, or [] when the search is done."""
        assert not self.done, "the beam search has ended"
        if log_probs.shape[0] == 1:
            log_probs = log_probs.expand(self.width, -1)  # as transformers, which runs the prompt width times
        vocab = log_probs.shape[-1]
        totals = (log_probs + self.running_scores[:, None]).reshape(-1)  # [width * vocab]
        top_scores, top_indices = torch.topk(totals, k=self.candidates_per_step)
        parents, tokens = top_indices // vocab, top_indices % vocab  # [candidates_per_step]
        generated_len = self.generated_len + 1
        ends = torch.isin(tokens, self.stop_token_ids) | (generated_len >= self.max_new_tokens)
        candidates = [self.running[p] + (t,) for p, t in zip(parents.tolist(), tokens.tolist())]
        next_beams = self._next_running(top_scores, ends, parents, tokens, candidates)
        self._keep_finished(top_scores, ends, candidates, generated_len)
        self._update_can_improve(generated_len)
        all_end = bool(ends.all())
        full_and_stopping = bool(self.is_finished.all()) and self.early_stopping is True
        self.done = not self.can_improve or full_and_stopping or all_end
        return [] if self.done else next_beams

    def _next_running(self, top_scores: torch.Tensor, ends: torch.Tensor, parents: torch.Tensor,
                      tokens: torch.Tensor, candidates: list[tuple[int, ...]]) -> list[tuple[int, int]]:
        """The best `width` candidates that do not end become the running beams (transformers'
        _get_running_beams_for_next_iteration)."""
        scores = top_scores + ends.to(torch.float32) * _NOT_A_CHOICE
        chosen = torch.topk(scores, k=self.width)[1]
        self.running_scores = scores[chosen]
        self.running = [candidates[i] for i in chosen.tolist()]
        return [(int(parents[i]), int(tokens[i])) for i in chosen.tolist()]

    def _keep_finished(self, top_scores: torch.Tensor, ends: torch.Tensor, candidates: list[tuple[int, ...]],
                       generated_len: int) -> None:
        """Candidates among the best `width` that end join the kept hypotheses if they score higher
        (transformers' _update_finished_beams)."""
        just_finished = ends.clone()
        just_finished[self.width:] = False
        scores = top_scores / (generated_len ** self.length_penalty)
        if bool(self.is_finished.all()) and self.early_stopping is True:
            scores = scores + _NOT_A_CHOICE
        if not self.can_improve:
            scores = scores + _NOT_A_CHOICE
        scores = scores + (~just_finished).to(torch.float32) * _NOT_A_CHOICE
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_finished = torch.cat((self.is_finished, just_finished))
        merged = self.finished + candidates
        kept = torch.topk(merged_scores, k=self.width)[1]
        self.finished_scores = merged_scores[kept]
        self.is_finished = merged_finished[kept]
        self.finished = [merged[i] for i in kept.tolist()]

    def _update_can_improve(self, generated_len: int) -> None:
        """Whether the best running beam could still beat the worst kept hypothesis (transformers'
        _check_early_stop_heuristic)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = generated_len
        best_possible = self.running_scores[:1] / (best_len ** self.length_penalty)
        worst_kept = torch.where(self.is_finished, self.finished_scores.min(), _NOT_A_CHOICE)
        self.can_improve = self.can_improve and bool((best_possible > worst_kept).any())

    def best(self, count: int) -> list[Hypothesis]:
        """The `count` best finished hypotheses, best first (call once the search is done)."""
        assert self.done, "the beam search has not ended"
        return [Hypothesis(self.finished[i], float(self.finished_scores[i]))
                for i in range(count) if bool(self.is_finished[i])]
