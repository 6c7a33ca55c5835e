"""How many drafts a sequence takes next: the count whose expected tokens per unit of step cost is highest.

A checking pass over d drafts yields 1 + a + a^2 + ... + a^d tokens on average when each draft is accepted
with probability a once those before it were (a geometric model of prompt lookup: a copied stretch goes on
or ends). It costs 1 + c + r * d plain steps, r being what one more row adds to a step: on a CPU the products'
work grows with the rows (about 0.45 of a one-row step on AVX2's int16 kernels, far less on AMX's bf16
tiles); c what a checking pass costs beyond its rows (each row's sampling, the comparison, taking the drafts
back): sampled open text at the `avx2` level, predicted 1.055x by the model without it (a = 0.54, r = 0.46),
ran 0.98x (docs/benchmarks/speculation.md), so c = 0.08. The budget takes the d <= K that maximises tokens /
cost, and no drafts where no d beats a plain step: on open text, where lookup rarely guesses right, a sequence
stops drafting after a few misses.

a is each sequence's own (DraftBudget): its accepted and rejected drafts, decayed so a stretch of copying or
of new text shows within a few passes. A sequence taking no drafts still learns, for free: the proposal it
would have taken is compared with the token the step then gives (a shadow draft), so drafting resumes when
the output starts copying again. r is the engine's (RowCost): fitted to the engine's own checking and plain
steps on a CPU (time = fixed + per row), decayed likewise, from a prior, and held within [0.02, 0.9]: within
that, a sequence copying for sure (a = 1) always drafts, so whether drafts are taken where they cannot fail
never hangs on timing (and drafts never change the output).
"""

from __future__ import annotations

DECAY = 0.8  # weight an estimate keeps at each new observation
PRIOR_ACCEPTED, PRIOR_DRAFTS = 1.0, 2.0  # a new sequence's acceptance: one half, worth two drafts
CPU_ROW_COST = 0.45  # r before a CPU engine has timed its own steps (AVX2's int16 products, measured)
GPU_ROW_COST = 0.05  # r on a GPU: a decode step's few rows are memory-bound, not timed (no sync is added)
MIN_ROW_COST, MAX_ROW_COST = 0.02, 0.9
PASS_COST = 0.08  # c: a checking pass's cost beyond its rows, as a share of a one-row step (module docstring)


def best_length(acceptance: float, row_cost: float, limit: int) -> int:
    """The d in 0..limit maximising (1 + a + ... + a^d) / (1 + c + r d); 0 where none beats a plain step."""
    best, best_value = 0, 1.0
    expected, term = 1.0, 1.0
    for d in range(1, limit + 1):
        term *= acceptance
        expected += term
        value = expected / (1.0 + PASS_COST + row_cost * d)
        if value > best_value * (1.0 + 1e-9):
            best, best_value = d, value
    return best


class DraftBudget:
    """One sequence's acceptance estimate and its pending shadow draft."""

    __slots__ = ("accepted", "drafts", "shadow_at", "shadow_token")

    def __init__(self) -> None:
        self.accepted = PRIOR_ACCEPTED  # decayed count of drafts accepted
        self.drafts = PRIOR_DRAFTS  # decayed count of drafts whose fate was seen (accepted, or the first rejected)
        self.shadow_at = -1  # the token position a shadow draft guessed; -1: none pending
        self.shadow_token = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafts

    def length(self, row_cost: float, limit: int) -> int:
        return best_length(self.acceptance, row_cost, limit)

    def after_pass(self, accepted: int, drafted: int) -> None:
        """A pass checked `drafted` drafts and accepted the first `accepted`: those, and the first rejected
        one, are observations; drafts after a rejection say nothing."""
        self._observe(accepted, accepted + (1 if accepted < drafted else 0))

    def guess(self, position: int, token: int) -> None:
        """A shadow draft: `token` proposed for `position`, not checked by the model."""
        self.shadow_at, self.shadow_token = position, token

    def settle_guess(self, token_ids: list[int]) -> None:
        """Learn from a pending shadow draft once its position holds the token the model chose."""
        if 0 <= self.shadow_at < len(token_ids):
            self._observe(1 if token_ids[self.shadow_at] == self.shadow_token else 0, 1)
            self.shadow_at = -1

    def _observe(self, accepted: int, drafts: int) -> None:
        if drafts:
            self.accepted = DECAY * self.accepted + accepted
            self.drafts = DECAY * self.drafts + drafts


class RowCost:
    """r: what a row adds to a decode step, as a share of a one-row step, fitted to timed single-sequence
    steps (each row count's time decayed; a line through them: time = fixed + per_row * rows)."""

    def __init__(self, prior: float, measure: bool) -> None:
        self.prior = prior
        self.measure = measure
        self.times: dict[int, float] = {}  # rows -> decayed seconds of a step of that many rows

    def observe(self, rows: int, seconds: float) -> None:
        if self.measure and seconds > 0:
            old = self.times.get(rows)
            self.times[rows] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    @property
    def value(self) -> float:
        if len(self.times) < 2:
            return self.prior
        n = len(self.times)
        mean_rows = sum(self.times) / n
        mean_time = sum(self.times.values()) / n
        spread = sum((rows - mean_rows) ** 2 for rows in self.times)
        per_row = sum((rows - mean_rows) * (t - mean_time) for rows, t in self.times.items()) / spread
        one_row = mean_time + per_row * (1 - mean_rows)  # the line's time at one row
        if one_row <= 0:
            return MAX_ROW_COST
        return min(MAX_ROW_COST, max(MIN_ROW_COST, per_row / one_row))
