"""One request's sequence: its tokens, its block table, and how far its KV has been computed.

A request with n > 1 is a group of n sequences with the same request_id, told apart by
`candidate_index`. Candidate 0 is queued alone; when its prompt is computed it forks into the
others (`fork`), which start with its tokens, block table and counters; the block references
themselves are taken by KVCacheManager.share_blocks.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pagecli.config.settings import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_model_len: int
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    block_table: list[int] = field(default_factory=list)  # physical block ids, in order
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time_s: float = field(default_factory=time.perf_counter)
    first_token_time_s: float | None = None
    rng: Any = None  # engine/sampler.RandomStream of a sampled sequence (None when greedy)
    candidate_index: int = 0  # which of the request's n candidates this is
    forked: bool = False  # candidate 0 of an n > 1 request, once its candidates exist
    num_draft: int = 0  # draft tokens at the end of token_ids for this step only (engine/speculation.py)
    spec: Any = None  # (DraftBudget, NgramIndex, or ProbeClock with a draft model) once it may take drafts
    grammar: Any = None  # engine/structured.GrammarState when the request constrains its output
    lora: Any = None  # models/lora.LoraAdapter this sequence runs (None: the base model)
    hash_root: bytes | None = None  # the root of its prefix-cache chains when not the model's (an adapter's)

    @property
    def needs_fork(self) -> bool:
        """Candidate 0 of an n > 1 request whose candidates do not exist yet."""
        return self.sampling.n > 1 and self.candidate_index == 0 and not self.forked

    def fork(self, candidate_index: int, rng: Any) -> Sequence:
        """A candidate that continues from this sequence's tokens. Its block table names the same
        blocks; the caller takes the references (KVCacheManager.share_blocks)."""
        return Sequence(
            self.request_id, self.prompt_token_ids, self.sampling, self.max_model_len,
            token_ids=list(self.token_ids), block_table=list(self.block_table),
            block_hashes=list(self.block_hashes), num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens, status=self.status, arrival=self.arrival,
            arrival_time_s=self.arrival_time_s, first_token_time_s=self.first_token_time_s,
            rng=rng, candidate_index=candidate_index, forked=True, lora=self.lora, hash_root=self.hash_root,
        )

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """len(output_token_ids) without copying them (a per-token check: the copy grows with the output)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time_s is None:
            self.first_token_time_s = time.perf_counter()
