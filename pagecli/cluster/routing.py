"""Prefix-aware routing: which worker runs a request, given its prompt's first blocks and every worker's load.

A request's route key is a digest of the first full KV blocks of its prompt's token ids (at most
ROUTE_BLOCKS of them), so prompts that start with the same blocks (a shared system prompt) go to the
same worker, whose prefix cache then serves them; a prompt shorter than one block has no key and goes
to the least-loaded worker. Workers are ranked for a key by rendezvous hashing (highest random weight),
so a worker that leaves moves only the keys it held. Load still spreads: the preferred worker is passed
over when it has no room or more requests in flight than the least-loaded worker plus `slack`; the
request then goes to the least-loaded worker that ranks highest for its key, so one prefix's overflow
keeps landing on the same second worker, which then computes that prefix once too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ROUTE_BLOCKS = 4  # enough to tell system prompts apart, few enough that a shared one decides the key
LOAD_SLACK = 4  # requests a worker may run above the least-loaded one and still get its own prefixes


def route_key(token_ids: Sequence[int], block_size: int, max_blocks: int = ROUTE_BLOCKS) -> bytes | None:
    """A stable digest of the prompt's first full blocks (the same in every process); None below one block."""
    full_blocks = min(len(token_ids) // block_size, max_blocks)
    if full_blocks == 0:
        return None
    head = ",".join(str(t) for t in token_ids[: full_blocks * block_size])
    return hashlib.blake2b(head.encode("ascii"), digest_size=16).digest()


def _rank(key: bytes, worker: str) -> bytes:
    return hashlib.blake2b(key + worker.encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Router:
    """Picks a worker for a request; None when every worker has `capacity` requests in flight (backpressure)."""

    capacity: int  # most requests in flight on one worker
    slack: int = LOAD_SLACK

    def choose(self, key: bytes | None, loads: Mapping[str, int]) -> str | None:
        """`loads`: each live worker's requests in flight."""
        if not loads:
            return None
        least = min(loads.values())
        if least >= self.capacity:
            return None
        if key is None:
            return min(loads, key=lambda w: (loads[w], w))
        ranked = sorted(loads, key=lambda w: _rank(key, w), reverse=True)
        preferred = ranked[0]
        if loads[preferred] < self.capacity and loads[preferred] <= least + self.slack:
            return preferred
        return next(w for w in ranked if loads[w] == least)
