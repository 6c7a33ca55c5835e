"""The pool checks run after every test that built an Engine (see the autouse fixture in conftest.py).

`check_engine_pool` raises AssertionError naming what is wrong: a block whose ref count does not
equal the number of sequences holding it, a hash index entry whose block holds other tokens than
the ones hashed, a sequence whose block hashes are not the chain of its tokens, or, once the engine
is idle, a block still active or request state left behind.

`HashInputs` records what the engine hashed (hash -> parent hash and token ids), so a cached block
can be checked against the tokens it was registered for, not only against itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import Any

from pagecli.engine import hashing
from pagecli.engine.hashing import chain_hashes

HashInputs = dict[bytes, tuple[bytes, tuple[int, ...]]]


def recording_block_hash(hash_inputs: HashInputs) -> Callable[[bytes, SequenceOf[int]], bytes]:
    """hashing.block_hash that also notes each digest's inputs in hash_inputs."""

    def block_hash(parent_hash: bytes, token_ids: SequenceOf[int]) -> bytes:
        digest = hashing.block_hash(parent_hash, token_ids)
        hash_inputs[digest] = (parent_hash, tuple(token_ids))
        return digest

    return block_hash


def check_engine_pool(engine: Any, hash_inputs: HashInputs | None = None) -> None:
    pool = engine.pool
    pool.check_invariants()
    _check_counts_agree_with_block_states(pool)
    _check_hash_index(pool, hash_inputs)
    live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    holders = Counter(block_id for seq in live for block_id in seq.block_table)
    # Blocks never made were never handed out (free, ref_count 0): only made or held ones can disagree.
    # Walking every block made millions of them for a tiny model's default pool (seconds per test).
    made = {block.block_id: block for block in pool.blocks.made()}
    for block_id in made.keys() | holders.keys():
        block = made.get(block_id)
        ref_count = block.ref_count if block is not None else 0
        assert ref_count == holders[block_id], (
            f"block {block_id} has ref_count {ref_count} but {holders[block_id]} sequence(s) hold it"
        )
    for seq in live:
        _check_sequence_chain(engine, seq)
    if not engine.has_unfinished:
        counts = pool.counts()
        assert counts.active == 0, f"the engine is idle but {counts.active} block(s) are still active (leaked)"
        assert not engine._requests, f"the engine is idle but holds request state for {sorted(engine._requests)}"


def _check_counts_agree_with_block_states(pool: Any) -> None:
    counts = pool.counts()
    states = Counter(pool.block_states())
    assert len(pool.blocks) == counts.total == pool.num_blocks
    assert states["free"] == counts.free and states["cached"] == counts.cached, (counts, states)
    assert states["active"] + states["shared"] == counts.active and states["shared"] == counts.shared, (counts, states)


def _check_hash_index(pool: Any, hash_inputs: HashInputs | None) -> None:
    for block_hash, block_id in pool.hash_to_block.items():
        block = pool.blocks[block_id]
        assert block.block_hash == block_hash, f"hash index names block {block_id}, which holds another hash"
        tokens = block.token_ids
        assert isinstance(tokens, tuple) and len(tokens) == pool.block_size, (
            f"cached block {block_id} holds {tokens!r}, not {pool.block_size} token ids"
        )
        if hash_inputs is not None:
            assert block_hash in hash_inputs, f"block {block_id} is registered under a hash the engine never computed"
            parent, hashed_tokens = hash_inputs[block_hash]
            assert tokens == hashed_tokens and hashing.block_hash(parent, tokens) == block_hash, (
                f"block {block_id} holds other tokens than the ones its hash was computed from"
            )


def _check_sequence_chain(engine: Any, seq: Any) -> None:
    """A sequence's hashed blocks are the hash chain of its tokens, and the blocks it holds say so."""
    block_size = engine.pool.block_size
    assert len(seq.block_hashes) <= len(seq.block_table), f"{seq.request_id}: more hashes than blocks"
    expected = chain_hashes(engine.kv.root_hash, seq.token_ids, block_size, len(seq.block_hashes))
    assert seq.block_hashes == expected, f"{seq.request_id}: block hashes are not the chain of its tokens"
    for i, block_hash in enumerate(seq.block_hashes):
        block = engine.pool.blocks[seq.block_table[i]]
        tokens = tuple(seq.token_ids[i * block_size : (i + 1) * block_size])
        if block.block_hash is not None:  # None: a private duplicate of a block another sequence registered
            assert block.block_hash == block_hash and block.token_ids == tokens, (
                f"{seq.request_id}: block {block.block_id} is registered under other tokens than the sequence's"
            )
