"""Block tables for sequences: prefix-cache matching, slot allocation, and release.

Sits between sequences and the BlockPool. A sequence's first `len(block_hashes)` blocks are
full, hashed and findable; the blocks after them are private to it. Blocks are released
tail first, so a chain's tail is evicted before its head.
"""

from __future__ import annotations

from pagecli.engine.block_pool import BlockPool
from pagecli.engine.hashing import block_hash
from pagecli.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, root_hash: bytes) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.root_hash = root_hash
        # Prefix-cache counters, in tokens (memory tier).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Take shared references to the cached full blocks that start seq; returns tokens hit.

        At most num_tokens - 1 tokens are served, so the last token is always computed
        (a fully cached prompt still needs its logits).
        """
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        max_full_blocks = (seq.num_tokens - 1) // self.block_size
        parent = self.root_hash
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
        hit_tokens = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = hit_tokens
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += hit_tokens
        return hit_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens more tokens; False (and no change) if the pool is short."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_reusable:
            return False
        for _ in range(needed):
            seq.block_table.append(self.pool.allocate().block_id)
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash and register the blocks that computing has filled since the last call."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else self.root_hash
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = block_hash(parent, tokens)
            seq.block_hashes.append(parent)
            self.pool.register(self.pool.blocks[seq.block_table[i]], parent, tokens)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
