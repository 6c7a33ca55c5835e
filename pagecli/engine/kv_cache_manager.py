"""Block tables for sequences: prefix-cache matching, slot allocation, and release.

Sits between sequences and the BlockPool. A sequence's first `len(block_hashes)` blocks are
full, hashed and findable; the blocks after them are private to it. Blocks are released
tail first, so a chain's tail is evicted before its head. A prefix match that runs out of
pool hits continues in an optional slower tier (the disk store), whose hits are loaded into
fresh pool blocks and registered there, so they are memory hits from then on.

Forked candidates (n > 1) share blocks by reference count (`share_blocks`). Copy-on-write: a
sequence never writes into a block another sequence references. Before new tokens are written,
`allocate_slots` gives the sequence its own copy of every shared block those tokens land in
(in practice the prompt's partial last block, once per candidate but the last) and queues the
copy (source -> destination) in `pending_copies`, which the engine runs before the step's forward.

A sequence with its own `hash_root` (a LoRA adapter's: engine/adapters.py) chains its blocks from that root,
so they are found only by sequences of the same adapter.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any, Protocol

from pagecli.engine.block_pool import BlockPool
from pagecli.engine.hashing import block_hash
from pagecli.engine.sequence import Sequence
from pagecli.store.cached_block import CachedBlock


class PrefixTier(Protocol):
    """A slower tier behind the pool that a prefix match continues into (the disk store)."""

    def find_run(self, hashes: list[bytes], token_blocks: list[list[int]]) -> SequenceOf[Any]:
        """The tier's entries for the longest leading run of these blocks it holds, tokens verified."""
        ...

    def load_run(self, run: SequenceOf[Any], block_ids: list[int]) -> int:
        """Write the run's KV into these pool blocks in one batched copy; returns how many leading blocks loaded."""
        ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, root_hash: bytes, slower_tier: PrefixTier | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root_hash = root_hash
        self.slower_tier = slower_tier if pool.enable_prefix_caching else None
        # Prefix-cache counters, in tokens: asked for, served by the pool, served by the slower tier.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_disk_hit_tokens = 0
        # Copy-on-write: destination block id -> source block id, copied before the next forward.
        self.pending_copies: dict[int, int] = {}
        # Sharing counters, in blocks: references forks took instead of allocating, and the copies made.
        self.fork_block_shares = 0
        self.cow_block_copies = 0
        # The adapter whose chain each registered hash of an adapter's sequence belongs to (the base's are not
        # kept), for the per-adapter block counts; entries of hashes the pool no longer holds are dropped.
        self._adapter_of_hash: dict[bytes, str] = {}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Take shared references to the cached full blocks that start seq; returns tokens hit.

        At most num_tokens - 1 tokens are served, so the last token is always computed
        (a fully cached prompt still needs its logits).
        """
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        max_full_blocks = (seq.num_tokens - 1) // self.block_size
        parent = self.root_of(seq)
        for i in range(max_full_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            h = block_hash(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                break
            self.pool.touch(block)
            seq.block_table.append(block.block_id)
            seq.block_hashes.append(h)
            parent = h
        memory_hit_tokens = len(seq.block_table) * self.block_size
        if self.slower_tier is not None and len(seq.block_table) < max_full_blocks:
            self._continue_in_slower_tier(seq, parent, max_full_blocks)
        hit_tokens = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = hit_tokens
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += memory_hit_tokens
        self.prefix_disk_hit_tokens += hit_tokens - memory_hit_tokens
        return hit_tokens

    def _continue_in_slower_tier(self, seq: Sequence, parent: bytes, max_full_blocks: int) -> None:
        """Load the tier's run of seq's next blocks into fresh pool blocks and register them."""
        assert self.slower_tier is not None
        start = len(seq.block_table)
        token_blocks = [seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
                        for i in range(start, max_full_blocks)]
        hashes = []
        for tokens in token_blocks:
            parent = block_hash(parent, tokens)
            hashes.append(parent)
        run = self.slower_tier.find_run(hashes, token_blocks)
        num_blocks = min(len(run), self.pool.num_reusable)
        if num_blocks == 0:
            return
        blocks = [self.pool.allocate() for _ in range(num_blocks)]
        num_loaded = self.slower_tier.load_run(run[:num_blocks], [b.block_id for b in blocks])
        for i, block in enumerate(blocks):
            if i < num_loaded:
                self.pool.register(block, hashes[i], token_blocks[i])
                self._note_adapter(seq, hashes[i])
                seq.block_table.append(block.block_id)
                seq.block_hashes.append(hashes[i])
            else:
                self.pool.release(block)  # a bad entry ended the run: these blocks go back unused

    def root_of(self, seq: Sequence) -> bytes:
        return seq.hash_root if seq.hash_root is not None else self.root_hash

    def cached_prefix(self, token_ids: SequenceOf[int], root: bytes | None = None) -> list[CachedBlock]:
        """The leading full blocks of token_ids that the pool holds (active or cached), in chain order; root:
        the chain's root when not the model's (an adapter's)."""
        found: list[CachedBlock] = []
        parent = self.root_hash if root is None else root
        for depth in range(len(token_ids) // self.block_size):
            tokens = token_ids[depth * self.block_size : (depth + 1) * self.block_size]
            h = block_hash(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                break
            found.append(CachedBlock(block.block_id, h, parent, depth, tuple(tokens)))
            parent = h
        return found

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens more tokens, first copying any shared block they
        land in (copy-on-write); False (and no change) if the pool is short."""
        if num_new_tokens == 1:  # a decode token (most calls): in a block of its own, nothing to do
            index = seq.num_computed_tokens // self.block_size
            if index < len(seq.block_table) and self.pool.blocks[seq.block_table[index]].ref_count == 1:
                return True
        needed = max(0, self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        shared = self._shared_blocks_written(seq, num_new_tokens)
        if needed + len(shared) > self.pool.num_reusable:
            return False
        for index in shared:
            self._copy_on_write(seq, index)
        for _ in range(needed):
            seq.block_table.append(self.pool.allocate().block_id)
        return True

    def _shared_blocks_written(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indexes into seq's block table of blocks that other sequences reference and the new tokens land in."""
        first = seq.num_computed_tokens // self.block_size
        last = min(self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens), len(seq.block_table))
        return [i for i in range(first, last) if self.pool.blocks[seq.block_table[i]].ref_count > 1]

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        """Give seq its own copy of the shared block at block_table[index]; the copy is queued."""
        source = self.pool.blocks[seq.block_table[index]]
        copy = self.pool.allocate()
        self.pending_copies[copy.block_id] = source.block_id
        self.pool.release(source)
        seq.block_table[index] = copy.block_id
        self.cow_block_copies += 1

    def share_blocks(self, parent: Sequence, child: Sequence) -> None:
        """Take the references of a forked child, whose block table names its parent's blocks."""
        assert child.block_table == parent.block_table, "a fork starts with its parent's block table"
        for block_id in child.block_table:
            self.pool.touch(self.pool.blocks[block_id])
        self.fork_block_shares += len(child.block_table)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The queued copy-on-write copies as (source, destination) block ids, emptying the queue."""
        copies = [(source, dest) for dest, source in self.pending_copies.items()]
        self.pending_copies.clear()
        return copies

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash and register the blocks that computing has filled since the last call."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else self.root_of(seq)
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = block_hash(parent, tokens)
            seq.block_hashes.append(parent)
            self.pool.register(self.pool.blocks[seq.block_table[i]], parent, tokens)
            self._note_adapter(seq, parent)

    def _note_adapter(self, seq: Sequence, block_hash: bytes) -> None:
        if seq.lora is None:
            return
        if len(self._adapter_of_hash) > 2 * self.pool.num_blocks:
            held = {block.block_hash for block in self.pool.blocks.made() if block.block_hash is not None}
            self._adapter_of_hash = {h: name for h, name in self._adapter_of_hash.items() if h in held}
        self._adapter_of_hash[block_hash] = seq.lora.name

    def blocks_by_adapter(self) -> dict[str, int]:
        """Per adapter, the pool's blocks (active or cached) that hold its hashed prefixes."""
        counts: dict[str, int] = {}
        if not self._adapter_of_hash:
            return counts
        for block in self.pool.blocks.made():
            name = None if block.block_hash is None else self._adapter_of_hash.get(block.block_hash)
            if name is not None:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def release_last_block(self, seq: Sequence) -> None:
        """Give back the last block of seq's table, which holds no computed token (speculative decoding's
        rejected drafts reached it)."""
        assert len(seq.block_hashes) < len(seq.block_table), "a committed block is never given back alone"
        block_id = seq.block_table.pop()
        self.pending_copies.pop(block_id, None)
        self.pool.release(self.pool.blocks[block_id])

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.pending_copies.pop(block_id, None)  # a copy into a block given back is not needed
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
