"""Which blocks to delete to bring the store under a size cap: LRU, tails before heads.

Only a leaf (a block no stored block continues) may go, so a chain shrinks from its tail and
its head, shared by the most prompts, goes last; a stored chain always starts at a prompt's
first block. Among leaves the least recently used goes first; a leaf's parent becomes a
leaf once its last child is gone.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

PruneRow = tuple[bytes, bytes, float, int, int]  # hash, parent hash, last used, depth, bytes


def plan_prune(rows: Iterable[PruneRow], max_bytes: int) -> list[bytes]:
    """Hashes to delete, in deletion order, so that the remaining blocks total at most max_bytes."""
    by_hash = {row[0]: row for row in rows}
    total = sum(row[4] for row in by_hash.values())
    if total <= max_bytes:
        return []
    children = Counter(row[1] for row in by_hash.values() if row[1] in by_hash)
    # Oldest first; among equally old leaves the deepest (a chain's tail) first.
    leaves = [(row[2], -row[3], row[0]) for row in by_hash.values() if children[row[0]] == 0]
    heapq.heapify(leaves)
    doomed: list[bytes] = []
    while total > max_bytes and leaves:
        _, _, block_hash = heapq.heappop(leaves)
        _, parent, _, _, num_bytes = by_hash[block_hash]
        doomed.append(block_hash)
        total -= num_bytes
        if parent in by_hash:
            children[parent] -= 1
            if children[parent] == 0:
                p = by_hash[parent]
                heapq.heappush(leaves, (p[2], -p[3], p[0]))
    return doomed
