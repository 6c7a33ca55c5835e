"""Speculative decoding inside the step: drafts proposed before scheduling, checked after the forward.

Before a step is scheduled, each eligible decoding sequence (no grammar, penalty, logit bias, forks or
beams; greedy or sampled) gets up to K draft tokens from prompt lookup (engine/ngram_proposer.py),
appended to its tokens for the step alone: the scheduler then gives it a chunk of 1 + K tokens, as it
gives a prefill chunk, and the runner returns logits for every position of that chunk. After the
forward, the model's own choice at each position is compared with the next draft: the drafts up to the
first disagreement are accepted, and the model's choice there (or after the last draft) is one more
token, so a step yields 1 to K + 1 tokens, each exactly the token plain decoding gives: each position's
logits see the same tokens before it (on the CPU the one-call decode step gives them plain decoding's
bits), and a sampled sequence's choice at each position is drawn with the word of its random stream
that plain decoding would use there (the words of positions past the first disagreement are handed
back). For a sampled sequence this is speculative sampling's rule for a draft that is one token for
sure (q = 1 at the draft): accept it with probability p(draft), else draw from p without it,
renormalised; drawing x from p and accepting where x is the draft does both at once. The drafts are
taken back out of the tokens before anything else reads them: the KV of the accepted ones is kept
(their positions count as computed), the rest is left to be overwritten, and blocks that only
rejected drafts reached go back to the pool. A sequence the scheduler could not give its whole chunk (the token budget, a preemption)
has its drafts taken back and runs a plain decode.

Drafts cost: a checking step computes every draft's row (on a CPU the products' work grows with the
rows), so drafts that keep failing would make a sequence slower than without them. Each sequence takes, at
each step, the number of drafts whose expected tokens per unit of step cost is highest, from its own
acceptance so far and the engine's measured cost of a row (engine/draft_budget.py): none where no number
beats a plain step, as on open text where lookup rarely guesses right; a free shadow guess each plain step
lets it resume when the output starts copying. Proposals come from each sequence's n-gram index
(ngram_proposer.NgramIndex), a few lookups a step, or with --speculate draft from a draft model's greedy
tokens (engine/draft_model.py): there a draft also costs a draft-model step (timed, added to r), and a
sequence that takes none probes with a real pass now and then instead of shadow guesses. And no sequence
takes drafts while more than `speculate_max_batch` run (8 unless told). A sequence among B weighs a draft row
against its own part of the batch's step (draft_budget.RowCost.costs: the steps of B sequences as timed, scaled
from one sequence's until they are), which is what kept sampled open text in batches of 4 from losing 8% (AMD
EPYC Zen 4): with it, batches of 2-8 ran open text at 0.97-1.05x and editing at 1.19-1.66x there
(docs/benchmarks/speculation.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from pagecli.attention.cpu_backend import SHORT_CHUNK_TOKENS
from pagecli.config.settings import EngineConfig
from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.draft_budget import (CPU_ROW_COST, GPU_ROW_COST, PROBE_DRAFTS, DraftBudget, ProbeClock, RowCost,
                                         batch_costs, draft_step_share)
from pagecli.engine.draft_model import DraftModel
from pagecli.engine.ngram_proposer import NgramIndex
from pagecli.engine.sampler import sample
from pagecli.engine.scheduler import SchedulerOutput
from pagecli.engine.sequence import Sequence
from pagecli.native.interface import CpuOps


def resolve_method(config: EngineConfig, model: Any, backend: Any, rows_exact: bool = True) -> str:
    """--speculate's method for this engine; auto is ngram where a checking step runs in the one-call decode
    step (a CPU with pagecli's kernels, a model they run in one call, drafts that fit a short chunk) on
    products that give each row its bits alone (rows_exact: WeightPlan.rows_exact): there it gives plain
    decoding's tokens bit for bit and was never measured below 0.95x of plain decoding (open text, greedy and
    sampled) while editing ran 1.3-1.7x (docs/benchmarks/speculation.md). Off elsewhere: on a GPU it is not
    measured yet, and the PyTorch path's checking chunks (or PyTorch's products) are not plain decoding's bits;
    asked for by name it runs there too, its tokens then plain decoding's up to the products' last bits."""
    if config.speculate != "auto":
        return config.speculate
    one_call = (getattr(model, "decode_step", None) is not None and getattr(backend, "cpu_ops", None) is not None
                and getattr(backend, "one_call_rows", None) is not None
                and 1 + config.num_speculative_tokens <= SHORT_CHUNK_TOKENS)
    return "ngram" if one_call and rows_exact else "off"


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may take drafts: nothing that makes a token depend on more than its logits row
    and its random word (grammar, penalties, bias), one candidate, no beams; decoding (all but its last
    token computed)."""
    params = seq.sampling
    return (seq.grammar is None and params.num_sequences == 1 and params.beam_width == 1
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias
            and seq.num_tokens > seq.num_prompt_tokens and seq.num_uncomputed_tokens == 1)


def lookup_drafts(budget: DraftBudget, index: NgramIndex, token_ids: list[int], room: int, row_cost: float,
                  pass_cost: float) -> list[int]:
    """Prompt lookup's drafts for a sequence's next step: as many of the index's proposal as the budget takes
    (at most `room`), or none where no count beats a plain step; the proposal's first token is then kept as a
    shadow guess that the next token settles (the budget's acceptance goes on learning without a row)."""
    budget.settle_guess(token_ids)
    length = budget.length(row_cost, room, pass_cost) if room > 0 else 0
    drafts = index.propose(token_ids, length or min(room, 1))
    if length:
        return drafts
    if drafts:
        budget.guess(len(token_ids), drafts[0])
    return []


class Speculator:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, on_cpu: bool = True,
                 drafter: DraftModel | None = None) -> None:
        self.drafter = drafter  # --speculate draft's model; None: prompt lookup
        self.num_tokens = config.num_speculative_tokens
        self.max_ngram = config.speculate_max_ngram
        self.max_batch = config.speculate_max_batch
        self.kv = kv
        # What a row adds to a step: timed on a CPU; a GPU's few decode rows cost next to nothing (and timing
        # them would need a sync).
        self.row_cost = RowCost(CPU_ROW_COST, measure=True) if on_cpu else RowCost(GPU_ROW_COST, measure=False)
        self.proposed = 0  # drafts checked
        self.accepted = 0  # drafts the model agreed with
        self.passes = 0  # sequence-steps that checked drafts
        self.tokens = 0  # tokens those steps yielded (accepted drafts and one more each)

    def counts(self) -> dict[str, int]:
        """The counters as EngineStats' spec_* fields."""
        return {"spec_drafts": self.proposed, "spec_accepted": self.accepted, "spec_passes": self.passes,
                "spec_tokens": self.tokens}

    def add_drafts(self, running: list[Sequence]) -> None:
        if len(running) > self.max_batch:
            return
        sequences = max(1, len(running))
        if self.drafter is not None:  # each draft also costs a draft-model step (the one-sequence figures, scaled)
            row_cost, pass_cost = self.row_cost.costs()
            row_cost += draft_step_share(self.drafter.seconds_per_draft, self.row_cost.plain_step_s)
            row_cost, pass_cost = batch_costs(row_cost, pass_cost, sequences)
        else:
            row_cost, pass_cost = self.row_cost.costs(sequences)
        for seq in running:
            if not speculates(seq):
                continue
            if seq.spec is None:
                seq.spec = (DraftBudget(), NgramIndex(self.max_ngram) if self.drafter is None else ProbeClock())
            budget, source = seq.spec
            room = min(self.num_tokens, seq.max_model_len - seq.num_tokens - 1,
                       seq.sampling.max_tokens - seq.num_output_tokens - 1)
            if self.drafter is not None:
                self._add_model_drafts(seq, budget, source, room, row_cost, pass_cost)
                continue
            drafts = lookup_drafts(budget, source, seq.token_ids, room, row_cost, pass_cost)
            if drafts:
                seq.token_ids.extend(drafts)
                seq.num_draft = len(drafts)

    def _add_model_drafts(self, seq: Sequence, budget: DraftBudget, clock: ProbeClock, room: int, row_cost: float,
                          pass_cost: float) -> None:
        """The draft model's tokens for seq: as many as the budget takes (the draft's steps counted in row_cost),
        or a probe's PROBE_DRAFTS when one is due (engine/draft_budget.py: no free shadow guesses here)."""
        if room <= 0:
            return
        length = budget.length(row_cost, room, pass_cost)
        if length:
            clock.drafting()
        elif clock.probe_due():
            length = min(room, PROBE_DRAFTS)
        else:
            return
        drafts = self.drafter.propose(seq, length)
        if drafts:
            seq.token_ids.extend(drafts)
            seq.num_draft = len(drafts)

    @staticmethod
    def timed_rows(scheduled: list) -> tuple[int, int] | None:
        """(sequences, rows) of a step the row cost learns from: every scheduled sequence decoding, plain or
        checking (taken before the step, as verify takes the drafts back), else None."""
        rows = 0
        for item in scheduled:
            if item.num_new_tokens != 1 + item.seq.num_draft or item.seq.num_tokens <= item.seq.num_prompt_tokens:
                return None
            rows += item.num_new_tokens
        return (len(scheduled), rows) if scheduled else None

    def observe_step(self, timed: tuple[int, int], seconds: float) -> None:
        """A step's time, from its forward to its tokens sampled and checked: every row of a checking pass is
        sampled too (a sampled row's temperature and top-p over the whole vocabulary are not free beside a small
        model's forward: sampled open text ran 0.87x when only the forward was timed), so the row cost counts it."""
        sequences, rows = timed
        self.row_cost.observe(rows, seconds, sequences)

    def settle(self, plan: SchedulerOutput, drafted: Iterable[Sequence]) -> SchedulerOutput:
        """The plan with every sequence whose drafts the scheduler did not take whole back to a plain
        decode (or to nothing, where it was not scheduled or was preempted)."""
        whole = {id(item.seq) for item in plan.scheduled if item.seq.num_draft and item.samples}
        cut = False
        for seq in drafted:
            if seq.num_draft and id(seq) not in whole:
                self._take_back(seq)
                self.give_back_unused_blocks(seq)  # slots the scheduler gave the drafts
                cut = True
        if not cut:
            return plan
        scheduled = [replace(item, num_new_tokens=min(item.num_new_tokens, item.seq.num_uncomputed_tokens))
                     for item in plan.scheduled]
        scheduled = [item for item in scheduled if item.num_new_tokens]
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first, as the scheduler leaves them
        return SchedulerOutput(scheduled, plan.num_preempted)

    def verify(self, sampled: list[Sequence], logits: torch.Tensor, ops: CpuOps | None
               ) -> tuple[list[Sequence], torch.Tensor, dict[int, list[int]]]:
        """Split the step's logits rows: the plain sequences with their rows, and for each drafting
        sequence (by id) the tokens it yields. Drafts are taken back out of the tokens here."""
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        yielded: dict[int, list[int]] = {}
        row = 0
        for seq in sampled:
            count = 1 + seq.num_draft
            if not seq.num_draft:
                plain.append(seq)
                plain_rows.append(row)
            else:
                drafts = seq.token_ids[-seq.num_draft :]
                # Greedy: each row's argmax; sampled: each row drawn with the next word of the stream.
                choices = sample(logits[row : row + count], [seq] * count, ops)
                accepted = 0
                while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
                    accepted += 1
                if seq.rng is not None:  # the words past the last token yielded go back to the stream
                    seq.rng.drawn -= count - (accepted + 1)
                self.proposed += len(drafts)
                self.accepted += accepted
                self.passes += 1
                self.tokens += accepted + 1
                self._take_back(seq)
                seq.spec[0].after_pass(accepted, len(drafts))
                yielded[id(seq)] = choices[: accepted + 1]
            row += count
        if len(plain) != len(sampled):
            logits = logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)]
        return plain, logits, yielded

    def give_back_unused_blocks(self, seq: Sequence) -> None:
        """Release the blocks past those the sequence's computed tokens and its next one need (reached
        only by rejected drafts)."""
        keep = self.kv.blocks_for_tokens(seq.num_computed_tokens + 1)
        while len(seq.block_table) > keep:
            self.kv.release_last_block(seq)

    @staticmethod
    def _take_back(seq: Sequence) -> None:
        del seq.token_ids[-seq.num_draft :]
        seq.num_draft = 0
