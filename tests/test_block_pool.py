"""Block pool and KV manager properties, under random operation sequences (hypothesis)."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from pagecli.config import SamplingParams
from pagecli.engine.block_pool import BlockPool, PoolCounts
from pagecli.engine.hashing import block_hash, chain_hashes, root_hash
from pagecli.engine.kv_cache_manager import KVCacheManager
from pagecli.engine.sequence import Sequence

BLOCK = 4
ROOT = root_hash("test-model")

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=14)),  # small vocab: many shared prefixes
        st.tuples(st.just("compute"), st.integers(0, 50), st.integers(1, 9)),
        st.tuples(st.just("append"), st.integers(0, 50), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    max_size=60,
)


def _kv_contents_tag(seq: Sequence, upto: int) -> list[tuple[int, ...]]:
    return [tuple(seq.token_ids[: (i + 1) * BLOCK]) for i in range(upto // BLOCK)]


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(4, 24), st.booleans())
def test_random_operations_keep_the_pool_consistent(operations, num_blocks, caching):
    pool = BlockPool(num_blocks, BLOCK, caching)
    kv = KVCacheManager(pool, ROOT)
    # What each physical block "holds": the full token prefix it was computed for (a stand-in for its KV).
    holds: dict[int, tuple[int, ...]] = {}
    live: list[Sequence] = []
    for op in operations:
        if op[0] == "add":
            seq = Sequence(f"r{len(live)}", list(op[1]), SamplingParams(), 10_000)
            kv.match_prefix(seq)
            for i, block_id in enumerate(seq.block_table):  # a hit must hold exactly this prefix
                assert holds[block_id] == tuple(seq.token_ids[: (i + 1) * BLOCK])
            live.append(seq)
        elif op[0] == "compute" and live:
            seq = live[op[1] % len(live)]
            n = min(op[2], seq.num_uncomputed_tokens)
            if n and kv.allocate_slots(seq, n):
                seq.num_computed_tokens += n
                for i in range(seq.num_computed_tokens // BLOCK):
                    holds[seq.block_table[i]] = tuple(seq.token_ids[: (i + 1) * BLOCK])
                kv.commit_full_blocks(seq)
        elif op[0] == "append" and live:
            seq = live[op[1] % len(live)]
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(op[2])
        elif op[0] == "free" and live:
            kv.free(live.pop(op[1] % len(live)))  # a finish or a preemption: both release every block
        pool.check_invariants()
        for seq in live:
            for block_id in seq.block_table:
                assert pool.blocks[block_id].ref_count >= 1
    for seq in live:
        kv.free(seq)
    pool.check_invariants()
    counts = pool.counts()
    assert counts.active == 0 and counts.free + counts.cached == num_blocks, "blocks leaked"


def test_a_cached_block_is_found_until_it_is_reused():
    pool = BlockPool(2, BLOCK)
    block = pool.allocate()
    h = block_hash(ROOT, [1, 2, 3, 4])
    pool.register(block, h, [1, 2, 3, 4])
    pool.release(block)
    assert pool.lookup(h, [1, 2, 3, 4]) is block  # cached: ref count 0 but findable
    assert pool.counts().cached == 1
    pool.allocate()  # the empty block is handed out first
    assert pool.lookup(h, [1, 2, 3, 4]) is block
    pool.allocate()  # now the cached one is evicted and reused
    assert pool.lookup(h, [1, 2, 3, 4]) is None
    assert pool.evictions == 1


def test_a_hash_hit_with_different_tokens_is_refused():
    pool = BlockPool(2, BLOCK)
    block = pool.allocate()
    h = block_hash(ROOT, [1, 2, 3, 4])
    pool.register(block, h, [1, 2, 3, 4])
    assert pool.lookup(h, [9, 9, 9, 9]) is None  # a forged collision never serves the wrong KV


def test_release_frees_tail_first_so_heads_outlive_tails():
    pool = BlockPool(4, BLOCK)
    kv = KVCacheManager(pool, ROOT)
    seq = Sequence("a", list(range(13)), SamplingParams(), 100)
    kv.match_prefix(seq)
    assert kv.allocate_slots(seq, 13)
    seq.num_computed_tokens = 13
    kv.commit_full_blocks(seq)
    head, middle, tail, partial = seq.block_table
    kv.free(seq)
    order = [pool.allocate().block_id for _ in range(4)]
    assert order == [partial, tail, middle, head]  # the empty block first, then the chain from its tail


def test_reuse_order_is_released_free_blocks_then_never_used_ones_then_cached_ones_oldest_first():
    pool = BlockPool(6, BLOCK)
    first, second, third, fourth = (pool.allocate() for _ in range(4))
    pool.register(third, block_hash(ROOT, [1, 2, 3, 4]), [1, 2, 3, 4])
    pool.register(fourth, block_hash(ROOT, [5, 6, 7, 8]), [5, 6, 7, 8])
    for block in (fourth, third, first, second):
        pool.release(block)
    order = [pool.allocate().block_id for _ in range(6)]
    assert order == [second.block_id, first.block_id, 4, 5, fourth.block_id, third.block_id]
    assert pool.evictions == 2


def test_a_million_block_pool_is_built_without_an_object_per_block():
    tracemalloc.start()
    try:
        pool = BlockPool(1_000_000, 16, True)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20, f"building the pool took {peak_bytes / (1 << 20):.1f} MiB"
    blocks = [pool.allocate() for _ in range(3)]
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert pool.counts() == PoolCounts(total=1_000_000, free=999_997, cached=0, active=3, shared=0)
    assert pool.block_states()[:4] == ["active", "active", "active", "free"]
    for block in blocks:
        pool.release(block)
    pool.check_invariants()
    assert pool.counts().free == 1_000_000


def test_shared_blocks_are_counted_as_references_come_and_go():
    pool = BlockPool(4, BLOCK)
    block = pool.allocate()
    pool.register(block, block_hash(ROOT, [1, 2, 3, 4]), [1, 2, 3, 4])
    pool.touch(block)
    pool.touch(block)
    assert pool.counts().shared == 1 and pool.block_states()[block.block_id] == "shared"
    pool.release(block)
    assert pool.counts().shared == 1
    pool.release(block)
    assert pool.counts().shared == 0 and pool.counts().active == 1
    pool.release(block)
    assert pool.counts() == PoolCounts(total=4, free=3, cached=1, active=0, shared=0)
    pool.touch(block)  # a prefix hit on the cached block
    assert pool.counts() == PoolCounts(total=4, free=3, cached=0, active=1, shared=0)
    pool.release(block)
    pool.check_invariants()


def test_hashes_are_stable_across_processes():
    import subprocess
    import sys

    code = "from pagecli.engine.hashing import chain_hashes, root_hash; print(chain_hashes(root_hash('m'), list(range(8)), 4, 2)[1].hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == chain_hashes(root_hash("m"), list(range(8)), 4, 2)[1].hex()
