"""Continuous batching: which sequences run this step, and with how many tokens.

Each step fills a token budget: running sequences first (oldest first: one decode token,
or the next chunk of an unfinished prefill), then waiting sequences (prefix-cache match,
then a prefill chunk). When blocks run out, the newest running sequence is preempted:
its blocks are released and it is recomputed later, so nothing is dropped and greedy
output is unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
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
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        return SchedulerOutput(scheduled, preempted)

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
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

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in list(queue):
                if seq.request_id == request_id:
                    if queue is self.waiting:
                        self.waiting.remove(seq)
                    self.finish(seq, "abort")
                    return seq
        return None
