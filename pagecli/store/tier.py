"""The disk store as the engine sees it: the tier behind the block pool.

`find_run` / `load_run` let the KV cache manager continue a prefix match on disk (one batched
copy into the pool per run); `persist` copies blocks out of the pool on the engine thread and
queues them for the background writer. Problems become lines in `warnings`, never exceptions.

What `persist` remembers as stored it forgets as soon as the store's deletion mark moves: a
block may have been dropped as bad, pruned, or lost with a replaced index since, and a chain
written with a block missing in the middle would never be hit past the gap.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pagecli.store.blobs import BlockGeometry
from pagecli.store.cached_block import CachedBlock
from pagecli.store.index import IndexedBlock, StoreUnavailable
from pagecli.store.prefix_store import BlockRecord, PrefixStore
from pagecli.store.writer import BackgroundWriter

CopyIn = Callable[[list[int], torch.Tensor], None]
CopyOut = Callable[[list[int]], torch.Tensor]


class DiskTier:
    def __init__(self, store: PrefixStore, copy_in: CopyIn, copy_out: CopyOut, warnings: list[str]) -> None:
        self.store = store
        self.warnings = warnings
        self._copy_in = copy_in
        self._copy_out = copy_out
        self._writer = BackgroundWriter(store, warnings.append)  # must not refer to the tier, or _close never runs
        self._seen_stored: set[bytes] = set()  # hashes the store held when asked, while _seen_mark holds
        self._seen_mark: tuple[int, int] | None = None
        self._close = weakref.finalize(self, _shut_down, self._writer, store)  # also runs at interpreter exit

    @classmethod
    def open(cls, root: Path, fingerprint: str, model_name: str, geometry: BlockGeometry, max_bytes: int | None,
             copy_in: CopyIn, copy_out: CopyOut, warnings: list[str]) -> DiskTier | None:
        """The tier over the store in root; None if the store cannot be used (the reason goes to warnings)."""
        try:
            store = PrefixStore(root, fingerprint, model_name, geometry, max_bytes, warnings.append)
        except StoreUnavailable:
            return None
        return cls(store, copy_in, copy_out, warnings)

    # --- reading ------------------------------------------------------------------------------
    def find_run(self, hashes: list[bytes], token_blocks: list[list[int]]) -> list[IndexedBlock]:
        return self.store.find_run(hashes, token_blocks)

    def load_run(self, run: Sequence[IndexedBlock], block_ids: list[int]) -> int:
        """Load the run's KV into these pool blocks with one batched copy; returns how many leading blocks loaded."""
        kv = self.store.read_run(run)  # [num_layers, 2, n, block_size, kv_heads, head_dim]
        if kv is None:
            return 0
        num_loaded = kv.shape[2]
        self._copy_in(block_ids[:num_loaded], kv)
        return num_loaded

    # --- writing ------------------------------------------------------------------------------
    def persist(self, blocks: Sequence[CachedBlock]) -> int:
        """Queue the blocks the store lacks (and are not queued already) for writing; returns how many were queued."""
        if self.store.disabled:
            return 0
        mark = self.store.deletion_mark()  # read before asking, so a deletion in between moves it
        if mark is None or mark != self._seen_mark:
            self._seen_stored.clear()
            self._seen_mark = mark
        unseen = [b for b in blocks if b.block_hash not in self._seen_stored]
        pending = self._writer.pending([b.block_hash for b in unseen])
        fresh = [b for b in unseen if b.block_hash not in pending]
        stored = self.store.stored([b.block_hash for b in fresh])
        if mark is not None:
            self._seen_stored.update(stored)
        todo = [b for b in fresh if b.block_hash not in stored]
        if not todo:
            return 0
        kv = self._copy_out([b.block_id for b in todo])  # [num_layers, 2, n, block_size, kv_heads, head_dim], CPU
        records = [BlockRecord(b.block_hash, b.parent_hash, b.depth, b.token_ids) for b in todo]
        self._writer.submit(records, kv)
        return len(todo)

    def flush(self) -> None:
        """Wait for queued writes."""
        self._writer.flush()

    def close(self) -> None:
        """Finish queued writes and close the index; the tier is unusable afterwards."""
        self._close()


def _shut_down(writer: BackgroundWriter, store: PrefixStore) -> None:
    writer.close(then=store.close)
