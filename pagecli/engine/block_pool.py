"""The block pool: physical KV blocks, their ref counts, and the in-memory prefix cache.

Invariants (checked by `check_invariants`, and by the tests after every operation):
- a block is in exactly one state: active (ref_count > 0), cached (ref_count 0, holds a
  findable prefix hash) or free (ref_count 0, holds nothing);
- every block with ref_count 0 is reusable, in this order: free blocks released since the
  start (most recently released first), then blocks never handed out (lowest id first), then
  cached blocks, least recently released first (lazy eviction: a cached block stays findable
  until it is taken for reuse);
- `hash_to_block[h]` names a block whose `block_hash` is h and whose token ids are the
  ones hashed, so a hit is verified by comparing tokens and never serves other KV.

Start-up costs nothing per block: a block's bookkeeping object is made the first time the block
is handed out or looked at, and blocks never handed out are one integer range, so a pool of a
million blocks is built in microseconds and holds only what its requests have touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
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


class Blocks:
    """The pool's blocks by id, each made on first access (then always the same object)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(f"block {block_id} is outside the pool of {self._num_blocks} blocks")
            block = self._made[block_id] = Block(block_id)
        return block

    def __iter__(self) -> Iterator[Block]:
        """Every block, making those not made yet: for checks on small pools."""
        return (self[i] for i in range(self._num_blocks))

    def made(self) -> Iterator[Block]:
        """The blocks made so far; every other block has never been touched (free, ref_count 0)."""
        return iter(self._made.values())

    def get_made(self, block_id: int) -> Block | None:
        return self._made.get(block_id)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self.hash_to_block: dict[bytes, int] = {}
        # Reusable blocks, in the order they are taken (see the invariants). Dicts give O(1) removal
        # by id (a prefix hit takes a cached block back) and O(1) pops at the right end.
        self._released_free: dict[int, None] = {}  # popped from the end: most recently released first
        self._never_used_from = 0  # blocks [_never_used_from, num_blocks) were never handed out
        self._cached: OrderedDict[int, None] = OrderedDict()  # popped from the front: least recent first
        self._num_shared = 0
        self.evictions = 0

    # --- allocation -------------------------------------------------------------------------
    @property
    def num_reusable(self) -> int:
        """Blocks that can be handed out now (free plus cached)."""
        return len(self._released_free) + self._num_never_used + len(self._cached)

    @property
    def _num_never_used(self) -> int:
        return self.num_blocks - self._never_used_from

    def allocate(self) -> Block:
        block = self.blocks[self._take_reusable_id()]
        if block.block_hash is not None:
            self._forget_hash(block)
            self.evictions += 1
        block.ref_count = 1
        return block

    def _take_reusable_id(self) -> int:
        if self._released_free:
            return self._released_free.popitem()[0]
        if self._never_used_from < self.num_blocks:
            self._never_used_from += 1
            return self._never_used_from - 1
        if self._cached:
            return self._cached.popitem(last=False)[0]
        raise OutOfBlocks()

    def touch(self, block: Block) -> None:
        """Take one more reference to an active or cached block (a prefix hit)."""
        if block.ref_count == 0:
            assert block.block_hash is not None, f"block {block.block_id} holds nothing to share"
            del self._cached[block.block_id]
        elif block.ref_count == 1:
            self._num_shared += 1
        block.ref_count += 1

    def release(self, block: Block) -> None:
        assert block.ref_count > 0, f"block {block.block_id} released more often than taken"
        block.ref_count -= 1
        if block.ref_count == 1:
            self._num_shared -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is None:
            self._released_free[block.block_id] = None  # empty blocks are reused first
        else:
            self._cached[block.block_id] = None  # most recently used cached block goes last

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

    # --- observation --------------------------------------------------------------------------
    def counts(self) -> PoolCounts:
        reusable = self.num_reusable
        return PoolCounts(
            total=self.num_blocks,
            free=reusable - len(self._cached),
            cached=len(self._cached),
            active=self.num_blocks - reusable,
            shared=self._num_shared,
        )

    def block_states(self) -> list[str]:
        """One of 'free', 'cached', 'active', 'shared' per block, for the pool map."""
        return [_state(self.blocks.get_made(i)) for i in range(self.num_blocks)]

    def check_invariants(self) -> None:
        reusable = {**self._released_free, **self._cached}
        assert len(reusable) == len(self._released_free) + len(self._cached), "a block is both free and cached"
        for block_id in reusable:
            block = self.blocks.get_made(block_id)
            assert block is not None and block.ref_count == 0, f"block {block_id} is queued for reuse but in use"
            assert block_id < self._never_used_from, f"never-used block {block_id} is also queued"
        for b in self.blocks.made():
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            never_used = b.block_id >= self._never_used_from
            assert (b.ref_count == 0) == (b.block_id in reusable or never_used), f"block {b.block_id} queue mismatch"
            assert (b.block_hash is None) == (b.token_ids is None), f"block {b.block_id} hash without tokens"
            if b.ref_count == 0:
                in_cached = b.block_id in self._cached
                assert in_cached == (b.block_hash is not None), f"block {b.block_id} is cached in name only"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.block_hash == h, f"hash index names block {block_id} which holds another hash"
        shared = sum(1 for b in self.blocks.made() if b.ref_count > 1)
        assert shared == self._num_shared, f"shared count {self._num_shared} != {shared}"
        c = self.counts()
        assert c.free + c.cached + c.active == c.total


def _state(block: Block | None) -> str:
    if block is None or (block.ref_count == 0 and block.block_hash is None):
        return "free"
    if block.ref_count == 0:
        return "cached"
    return "shared" if block.ref_count > 1 else "active"
