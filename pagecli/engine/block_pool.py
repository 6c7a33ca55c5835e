"""The block pool: physical KV blocks, their ref counts, and the in-memory prefix cache.

Invariants (checked by `check_invariants`, and by the tests after every operation):
- a block is in exactly one state: active (ref_count > 0), cached (ref_count 0, holds a
  findable prefix hash) or free (ref_count 0, holds nothing);
- every block with ref_count 0 sits in the free queue, which is ordered for reuse:
  free blocks first, then cached blocks least recently released first (lazy eviction:
  a cached block stays findable until it is popped for reuse);
- `hash_to_block[h]` names a block whose `block_hash` is h and whose token ids are the
  ones hashed, so a hit is verified by comparing tokens and never serves other KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens of a hashed (full) block


@dataclass(frozen=True)
class PoolCounts:
    total: int
    free: int
    cached: int
    active: int
    shared: int  # active blocks with ref_count > 1 (counted in active too)


class OutOfBlocks(Exception):
    """No block can be allocated; the scheduler preempts or waits."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[bytes, int] = {}
        # Reuse order: front is taken first. OrderedDict gives O(1) remove/append at both ends.
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._num_cached = 0
        self.evictions = 0

    # --- allocation -------------------------------------------------------------------------
    @property
    def num_reusable(self) -> int:
        """Blocks that can be handed out now (free plus cached)."""
        return len(self._free_queue)

    def allocate(self) -> Block:
        if not self._free_queue:
            raise OutOfBlocks()
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._forget_hash(block)
            self.evictions += 1
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Take one more reference to a block (a prefix hit)."""
        if block.ref_count == 0:
            del self._free_queue[block.block_id]
            if block.block_hash is not None:
                self._num_cached -= 1
        block.ref_count += 1

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} released more often than taken"
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is None:
            self._free_queue[block.block_id] = None
            self._free_queue.move_to_end(block.block_id, last=False)  # empty blocks are reused first
        else:
            self._free_queue[block.block_id] = None  # most recently used cached block goes last
            self._num_cached += 1

    # --- prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        if not self.enable_prefix_caching:
            return None
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None  # a digest collision: never serve KV of other tokens
        return block

    def register(self, block: Block, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Make a full, active block findable by its chained hash (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.hash_to_block:
            return  # an identical block exists; this one stays private and is freed as empty
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.hash_to_block[block_hash] = block.block_id

    def _forget_hash(self, block: Block) -> None:
        if self.hash_to_block.get(block.block_hash) == block.block_id:  # type: ignore[arg-type]
            del self.hash_to_block[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None
        block.token_ids = None
        self._num_cached -= 1

    # --- observation --------------------------------------------------------------------------
    def counts(self) -> PoolCounts:
        free_or_cached = len(self._free_queue)
        return PoolCounts(
            total=self.num_blocks,
            free=free_or_cached - self._num_cached,
            cached=self._num_cached,
            active=self.num_blocks - free_or_cached,
            shared=sum(1 for b in self.blocks if b.ref_count > 1),
        )

    def block_states(self) -> list[str]:
        """One of 'free', 'cached', 'active', 'shared' per block, for the pool map."""
        states = []
        for b in self.blocks:
            if b.ref_count > 1:
                states.append("shared")
            elif b.ref_count == 1:
                states.append("active")
            else:
                states.append("cached" if b.block_hash is not None else "free")
        return states

    def check_invariants(self) -> None:
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            assert (b.ref_count == 0) == (b.block_id in self._free_queue), f"block {b.block_id} queue mismatch"
            assert (b.block_hash is None) == (b.token_ids is None), f"block {b.block_id} hash without tokens"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.block_hash == h, f"hash index names block {block_id} which holds another hash"
        cached = sum(1 for b in self.blocks if b.ref_count == 0 and b.block_hash is not None)
        assert cached == self._num_cached, f"cached count {self._num_cached} != {cached}"
        c = self.counts()
        assert c.free + c.cached + c.active == c.total
