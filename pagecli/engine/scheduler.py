"""Continuous batching: which sequences run this step, and with how many tokens.

Each step fills a token budget: running sequences first (oldest first: one decode token,
or the next chunk of an unfinished prefill), then waiting sequences (prefix-cache match,
then a prefill chunk). When blocks run out, the newest running sequence is preempted:
its blocks are released and it is recomputed later, so nothing is dropped and greedy
output is unchanged.

A request with n > 1 is admitted as candidate 0 with seats for all n (max_num_seqs counts
them); its forked candidates join `running` right after it. The candidates of one request
(same request_id) are preempted together when another request needs their blocks: preempting
one alone frees nothing its siblings still share. A request whose own candidates outgrow the
pool gives way one candidate at a time instead (newest first). Each preempted candidate resumes
as its own sequence, keeping its tokens and its random stream, so its output does not change;
with prefix caching the prompt's full blocks are shared again (without it, recomputed per
candidate).

A beam of a beam search (engine/beam_groups.py) whose next-token row is in but whose siblings' are not
stays running with nothing to compute: the scheduler passes over it (it holds its blocks and its seat).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's chunk this step. Not frozen: one is built per running sequence per step, and a frozen
    dataclass takes about 5x as long to build (0.86 us against 0.16)."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # single-token chunks first, then longer prefill chunks
    num_preempted: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = 0
        i = 0
        # Invariant: scheduled names running[:i], in order (preempting a group keeps that true).
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:  # a beam whose row is in, waiting for its siblings' (engine/beam_groups.py)
                scheduled.append(ScheduledSeq(seq, 0))
                i += 1
                continue
            if self.kv.allocate_slots(seq, num_new):
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            victims = self._preempt_newest(seq)
            preempted += len(victims)
            budget += sum(s.num_new_tokens for s in scheduled if s.seq in victims)
            scheduled = [s for s in scheduled if s.seq not in victims]
            i = len(scheduled)
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        scheduled = [s for s in scheduled if s.num_new_tokens]  # parked beams run nothing
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        return SchedulerOutput(scheduled, preempted)

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        for seq in list(self.waiting):
            if budget <= 0 or not self._has_seats_for(seq):
                break
            if self._waits_for_inflight_prefix(seq):
                continue  # a running prefill is computing blocks this prompt starts with: hit them next step
            if not seq.block_table:
                hit_tokens = self.kv.match_prefix(seq)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.allocate_slots(seq, num_new):
                self.kv.free(seq)  # give back the prefix hits; try again next step
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return budget

    def _has_seats_for(self, seq: Sequence) -> bool:
        """Whether max_num_seqs leaves room for seq and, before its fork, its candidates; a request with
        more candidates than max_num_seqs still runs, alone."""
        seats = seq.sampling.num_sequences if seq.num_tokens == seq.num_prompt_tokens else 1  # before the fork
        return not self.running or len(self.running) + seats <= self.max_num_seqs

    def add_forked(self, parent: Sequence, candidates: list[Sequence]) -> None:
        """Put a running parent's new candidates right after it (they hold its blocks already)."""
        at = self.running.index(parent) + 1
        self.running[at:at] = candidates

    def _waits_for_inflight_prefix(self, seq: Sequence) -> bool:
        """Whether a running sequence is prefilling, right now, a full block that seq's prompt also
        starts with (after the same committed blocks). Admitted now, seq would compute those tokens
        a second time (a shared system prompt sent as one batch); a step later they are cached.
        Never true without prefix caching, and the running prefill always progresses."""
        if not self.kv.pool.enable_prefix_caching or seq.block_table:
            return False
        bs = self.kv.block_size
        max_full_blocks = (seq.num_tokens - 1) // bs  # as match_prefix: the last token is always computed
        for other in self.running:
            committed = len(other.block_hashes)
            if other.num_computed_tokens >= other.num_prompt_tokens or committed >= max_full_blocks:
                continue
            if (committed + 1) * bs > other.num_prompt_tokens:
                continue  # its next block is not a full prompt block
            block = slice(committed * bs, (committed + 1) * bs)  # the block `other` is computing now
            if (seq.token_ids[block] == other.token_ids[block]
                    and seq.token_ids[: block.start] == other.token_ids[: block.start]):
                return True
        return False

    def _preempt_newest(self, needy: Sequence) -> list[Sequence]:
        """Preempt the newest running sequence with every running candidate of its request; returns them.
        Within needy's own request only the newest goes, so a group too large for the pool still
        progresses: its candidates give way one by one, down to needy alone (which always fits)."""
        newest = self.running[-1]
        if newest.request_id == needy.request_id:
            victims = [newest]
        else:
            victims = [s for s in self.running if s.request_id == newest.request_id]
        self.running = [s for s in self.running if s not in victims]
        for seq in reversed(victims):  # the group waits at the front, in candidate order
            self._preempt(seq)
        return victims

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request (all its candidates); returns them."""
        aborted = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in aborted:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.finish(seq, "abort")
        return aborted
