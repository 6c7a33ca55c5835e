"""How many drafts a sequence takes next: the count whose expected tokens per unit of step cost is highest.

A checking pass over d drafts yields 1 + a + a^2 + ... + a^d tokens on average when each draft is accepted
with probability a once those before it were (a geometric model of prompt lookup: a copied stretch goes on
or ends). It costs 1 + c + r * d plain steps: r what one more row adds to a step (on a CPU the products' work
grows with the rows: about 0.45 of a one-row step on AVX2's int16 kernels, 0.2-0.25 on AVX-512's, far less on
AMX's bf16 tiles), c what a checking pass costs beyond its rows (timed on AMD EPYC Zen 5: a one-row step 5.2 ms,
two rows 7.1, then about 1.2 ms a row; c about 0.12). The budget takes the d <= K that maximises tokens / cost
where that beats a plain step by HURDLE (5%), and no drafts otherwise: on open text, where lookup rarely
guesses right, a sequence stops drafting after a few misses, and a pass the estimates put at break-even (sampled
open text: a = 0.37, 1.01 predicted; 0.87-1.03x measured) is not taken, since a and r are estimates.

a is each sequence's own (DraftBudget): its accepted and rejected drafts, decayed so a stretch of copying or
of new text shows within a few passes. A sequence taking no drafts still learns, for free: the proposal it
would have taken is compared with the token the step then gives (a shadow draft), so drafting resumes when
the output starts copying again. r and c are the engine's (RowCost): fitted to the engine's own timed steps of
one decoding sequence on a CPU, from the forward to its tokens sampled (a sampled row's sampling counts), each
row count's time decayed likewise: r the slope of a line through the checking passes' times, c that line at one
row over a plain step's time; from priors until steps of two row counts are timed (and until two counts of
checking passes are, for c), held within
[0.02, 0.6] and [0, 0.3]: within those, a sequence copying for sure (a = 1) always drafts, so whether drafts are
taken where they cannot fail never hangs on timing (and drafts never change the output). Where drafts are allowed
in a batch (speculate_max_batch), r and c are a sequence's part of the batch's step: fitted likewise to the
engine's timed steps of that many decoding sequences (RowCost.costs), and scaled from the one-sequence figures
(batch_costs) until those are timed.
"""

from __future__ import annotations

DECAY = 0.8  # weight an estimate keeps at each new observation
PRIOR_ACCEPTED, PRIOR_DRAFTS = 1.0, 2.0  # a new sequence's acceptance: one half, worth two drafts
CPU_ROW_COST = 0.45  # r before a CPU engine has timed its own steps (AVX2's int16 products, measured)
GPU_ROW_COST = 0.05  # r on a GPU: a decode step's few rows are memory-bound, not timed (no sync is added)
MIN_ROW_COST, MAX_ROW_COST = 0.02, 0.6
# In a batch a draft row is weighed against a sequence's part of the step (batch_costs), which can be most of
# what the row costs: timed there, r is held below this (a share of the part, not of a one-row step).
MAX_BATCH_ROW_COST = 1.0
PASS_COST = 0.12  # c before a CPU engine has timed checking passes of two row counts (module docstring)
MAX_PASS_COST = 0.3  # with MAX_ROW_COST: one draft copied for sure still clears HURDLE (2 / 1.9)
HURDLE = 1.05  # drafts only where the estimates put a pass's tokens per cost this far above a plain step's
# A sequence's own cap on d, below the engine's K: FIRST_CAP at first and after any pass that rejected a draft,
# doubled after a pass that accepted every one of at least its cap (a copying stretch), up to K. A long pass
# pays where the output copies for certain (editing: 1.88x at K = 8 against 1.66x at 4) and costs where an
# acceptance estimate rose on a short run (sampled open text: 1.03x at a fixed 8 against 1.16x at 4,
# docs/benchmarks/speculation.md).
FIRST_CAP = 4
# A draft model (engine/draft_model.py) adds its own steps to a pass: one per draft, as a share of a plain main
# step, added to r. Before both are timed the share is taken as one half (a draft model is there to be cheaper).
DRAFT_SHARE_PRIOR = 0.5
# A sequence that takes no drafts from a draft model learns by a real pass of PROBE_DRAFTS drafts (a shadow
# guess would cost a draft step each plain step): the first after FIRST_PROBE_AFTER plain steps (so a plain step
# is timed first), then every PROBE_EVERY, the interval doubling after each probe up to MAX_PROBE_EVERY (a probe
# also brings the draft's mirror up to date: a chunk of the steps since the last one) and back to PROBE_EVERY
# once the budget drafts again.
PROBE_DRAFTS = 2
FIRST_PROBE_AFTER = 2
PROBE_EVERY, MAX_PROBE_EVERY = 8, 64


def best_length(acceptance: float, row_cost: float, limit: int, pass_cost: float = PASS_COST) -> int:
    """The d in 0..limit maximising (1 + a + ... + a^d) / (1 + c + r d); 0 where none beats a plain step by
    HURDLE."""
    best, best_value = 0, HURDLE
    expected, term = 1.0, 1.0
    for d in range(1, limit + 1):
        term *= acceptance
        expected += term
        value = expected / (1.0 + pass_cost + row_cost * d)
        if value > best_value * (1.0 + 1e-9):
            best, best_value = d, value
    return best


class DraftBudget:
    """One sequence's acceptance estimate and its pending shadow draft."""

    __slots__ = ("accepted", "cap", "drafts", "shadow_at", "shadow_token")

    def __init__(self) -> None:
        self.cap = FIRST_CAP  # the most drafts this sequence takes next (FIRST_CAP's comment)
        self.accepted = PRIOR_ACCEPTED  # decayed count of drafts accepted
        self.drafts = PRIOR_DRAFTS  # decayed count of drafts whose fate was seen (accepted, or the first rejected)
        self.shadow_at = -1  # the token position a shadow draft guessed; -1: none pending
        self.shadow_token = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafts

    def length(self, row_cost: float, limit: int, pass_cost: float = PASS_COST) -> int:
        return best_length(self.acceptance, row_cost, min(limit, self.cap), pass_cost)

    def after_pass(self, accepted: int, drafted: int) -> None:
        """A pass checked `drafted` drafts and accepted the first `accepted`: those, and the first rejected
        one, are observations; drafts after a rejection say nothing. All of at least the cap accepted doubles
        the cap; a rejection sets it back to FIRST_CAP."""
        self._observe(accepted, accepted + (1 if accepted < drafted else 0))
        if accepted < drafted:
            self.cap = FIRST_CAP
        elif drafted >= self.cap:
            self.cap *= 2

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


def batch_costs(row_cost: float, pass_cost: float, sequences: int) -> tuple[float, float]:
    """(r, c) for one of `sequences` decoding together, as shares of that sequence's part of a plain step. With a
    step of R rows costing 1 + r (R - 1) one-row steps (a batch's rows cost about what a sequence's draft rows do:
    on a CPU the products' work grows with the rows), a sequence's part of a plain batch step is (1 + r (B - 1)) / B
    of a one-row step: a draft row costs r of a one-row step, so B r / (1 + r (B - 1)) of that part; the pass's
    own cost c is shared by the sequences drafting, taken as all of them. At B = 1 both are as given."""
    share = (1.0 + row_cost * (sequences - 1)) / sequences
    return row_cost / share, pass_cost / sequences / share


def draft_step_share(seconds_per_draft: float | None, plain_step_s: float | None) -> float:
    """What a draft model's step adds to a checking pass per draft, as a share of a plain main step (r grows by
    it): the two timed figures' ratio, DRAFT_SHARE_PRIOR until both are known."""
    if seconds_per_draft is None or not plain_step_s:
        return DRAFT_SHARE_PRIOR
    return seconds_per_draft / plain_step_s


class ProbeClock:
    """When a sequence that takes no drafts from a draft model tries a real pass (module constants)."""

    __slots__ = ("interval", "plain_steps")

    def __init__(self) -> None:
        self.interval = PROBE_EVERY
        self.plain_steps = PROBE_EVERY - FIRST_PROBE_AFTER

    def drafting(self) -> None:
        """The budget took drafts: probes, when they are needed again, start at the short interval."""
        self.interval, self.plain_steps = PROBE_EVERY, 0

    def probe_due(self) -> bool:
        """Count a step without drafts; True (and the interval doubled) when it should probe instead."""
        self.plain_steps += 1
        if self.plain_steps <= self.interval:
            return False
        self.plain_steps, self.interval = 0, min(2 * self.interval, MAX_PROBE_EVERY)
        return True


class RowCost:
    """r (value) and c (pass_cost): what a row adds to a decode step and what a checking pass adds beyond its rows,
    as shares of a one-row step, fitted to timed steps of decoding sequences (module docstring); for a batch of
    B, as shares of a sequence's part of a plain step of B (batch_costs), from the steps timed at B where there
    are enough of them."""

    def __init__(self, prior: float, measure: bool) -> None:
        self.prior = prior
        self.measure = measure
        # sequences -> rows -> decayed seconds of a step of that many decoding sequences and rows in all
        self.times: dict[int, dict[int, float]] = {}

    def observe(self, rows: int, seconds: float, sequences: int = 1) -> None:
        """A step of `sequences` decoding sequences, `rows` rows in all (their drafts included), took `seconds`."""
        if self.measure and seconds > 0:
            times = self.times.setdefault(sequences, {})
            old = times.get(rows)
            times[rows] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def costs(self, sequences: int = 1) -> tuple[float, float]:
        """(r, c) for one of `sequences` decoding together, from the steps timed so far, each within its bounds.
        One sequence: the module docstring's fit. A batch of B: a line through the timed checking passes of B
        sequences (two row counts at least) over the timed plain step of B: a draft row costs the line's slope
        of a sequence's part of that step (plain / B), and what a pass costs beyond its rows is shared by the B
        (as batch_costs shares it); until such steps are timed, batch_costs scales the one-sequence figures.
        Timed, a batch's rows showed what the scaling missed (Zen 4, bf16 batches of 4: a plain step 11.4 ms,
        ~1.2 ms a draft row, r = 0.42 of a sequence's part where the one-sequence fit scaled gave ~0.3)."""
        if sequences <= 1:
            return self._one_sequence()
        own = self.times.get(sequences, {})
        plain = own.get(sequences)
        passes = {rows: t for rows, t in own.items() if rows > sequences}
        if plain is None or len(passes) < 2:
            return batch_costs(*self._one_sequence(), sequences)
        per_row, at_plain = _line(passes, sequences)
        return (min(MAX_BATCH_ROW_COST, max(MIN_ROW_COST, per_row * sequences / plain)),
                min(MAX_PASS_COST, max(0.0, (at_plain - plain) / plain)))

    def _one_sequence(self) -> tuple[float, float]:
        times = self.times.get(1, {})
        passes = {rows: t for rows, t in times.items() if rows > 1}
        if 1 in times and len(passes) >= 2:  # the passes' own line, over a plain step
            per_row, at_one = _line(passes)
            one_row = times[1]
            return (min(MAX_ROW_COST, max(MIN_ROW_COST, per_row / one_row)),
                    min(MAX_PASS_COST, max(0.0, at_one / one_row - 1.0)))
        if len(times) < 2:
            return self.prior, PASS_COST
        per_row, at_one = _line(times)
        return (MAX_ROW_COST if at_one <= 0 else min(MAX_ROW_COST, max(MIN_ROW_COST, per_row / at_one))), PASS_COST

    @property
    def plain_step_s(self) -> float | None:
        """The decayed time of a plain one-row step, None until one is timed."""
        return self.times.get(1, {}).get(1)

    @property
    def value(self) -> float:
        return self.costs()[0]

    @property
    def pass_cost(self) -> float:
        return self.costs()[1]


def _line(times: dict[int, float], at: int = 1) -> tuple[float, float]:
    """The least-squares line through (rows, seconds) points: its slope, and its value at `at` rows."""
    n = len(times)
    mean_rows = sum(times) / n
    mean_time = sum(times.values()) / n
    spread = sum((rows - mean_rows) ** 2 for rows in times)
    per_row = sum((rows - mean_rows) * (t - mean_time) for rows, t in times.items()) / spread
    return per_row, mean_time + per_row * (at - mean_rows)
