"""One model's view of a prefix store directory: find, read and write runs of KV blocks.

Nothing here raises into the engine: a bad blob is dropped from the index and reported once
through `warn` (the block is then recomputed), a corrupt index is replaced by an empty one,
and a store that cannot be used (locked too long, disk full, unwritable) disables itself for
the rest of the process with one warning. Each thread gets its own SQLite connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pagecli.store.blobs import BadBlob, BlockGeometry, decode_block, encode_block
from pagecli.store.files import blob_rel_path, checksum, remove_blob, write_atomic
from pagecli.store.index import (
    IndexCorrupt, IndexedBlock, StoreIndex, StoreUnavailable, encode_token_ids, open_index, reset_index,
    translate_errors,
)


@dataclass(frozen=True)
class BlockRecord:
    """What the index keeps about one block besides its blob."""

    block_hash: bytes
    parent_hash: bytes
    depth: int
    token_ids: tuple[int, ...]


class PrefixStore:
    def __init__(self, root: Path, fingerprint: str, model_name: str, geometry: BlockGeometry,
                 max_bytes: int | None, warn: Callable[[str], None]) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.model_name = model_name
        self.geometry = geometry
        self.max_bytes = max_bytes
        self.disabled = False
        self.blocks_written = 0
        self.bytes_written = 0
        self._warn = warn
        self._local = threading.local()
        self._generation = 0  # bumped when the index is replaced, so every thread reopens it
        self._open_lock = threading.Lock()
        self._connections: list[StoreIndex] = []
        self.model_id = 0
        with self._guard():
            self.model_id = self._index().model_id(fingerprint, model_name)
        if self.disabled:
            raise StoreUnavailable(f"the prefix store in {root} cannot be used")

    # --- connections and failures -------------------------------------------------------------
    def _index(self) -> StoreIndex:
        local = self._local
        if getattr(local, "generation", None) != self._generation:
            with self._open_lock:
                local.index = open_index(self.root, self._warn)
                local.generation = self._generation
                self._connections.append(local.index)
        return local.index

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn store failures into warnings: a corrupt index is reset, an unusable store disabled."""
        try:
            with translate_errors(self.root):
                yield
        except IndexCorrupt as exc:
            self._warn(f"The prefix store index broke ({exc}); started an empty one. Cached prefixes are "
                       "recomputed as needed.")
            self._replace_index()
        except (StoreUnavailable, OSError) as exc:
            self.disabled = True
            self._warn(f"The disk prefix store is off for this run: {exc}")

    def _replace_index(self) -> None:
        with self._open_lock:
            self._generation += 1
            try:
                index = reset_index(self.root)
                self.model_id = index.model_id(self.fingerprint, self.model_name)
                self._local.index = index
                self._local.generation = self._generation
                self._connections.append(index)
            except (StoreUnavailable, IndexCorrupt, OSError) as exc:
                self.disabled = True
                self._warn(f"The disk prefix store is off for this run: {exc}")

    def close(self) -> None:
        with self._open_lock:
            for index in self._connections:
                index.close()
            self._connections.clear()
            self._generation += 1

    # --- reading ------------------------------------------------------------------------------
    def find_run(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[IndexedBlock]:
        """The stored blocks that continue a chain: the longest leading run of hashes the store has
        for this model, each with exactly these tokens (so a digest collision is a miss)."""
        if self.disabled or not hashes:
            return []
        found: dict[bytes, IndexedBlock] = {}
        with self._guard():
            found = self._index().blocks(self.model_id, hashes)
        run: list[IndexedBlock] = []
        for block_hash, tokens in zip(hashes, token_blocks):
            entry = found.get(block_hash)
            if entry is None or entry.token_ids != encode_token_ids(tokens):
                break
            run.append(entry)
        return run

    def read_run(self, run: Sequence[IndexedBlock]) -> torch.Tensor | None:
        """KV of the leading blocks of run that read back intact: [num_layers, 2, n, block_size, kv_heads,
        head_dim]; None if the first is bad. A bad blob ends the run: it is dropped and reported once."""
        blocks: list[torch.Tensor] = []
        for entry in run:
            try:
                data = (self.root / entry.blob_path).read_bytes()
                blocks.append(decode_block(data, entry.checksum, entry.block_hash, self.geometry))
            except FileNotFoundError:
                self._drop_bad(entry, "its blob file is missing", missing=True)
                break
            except (BadBlob, OSError) as exc:
                self._drop_bad(entry, str(exc), missing=False)
                break
        if not blocks:
            return None
        with self._guard():
            self._index().touch([e.block_hash for e in run[: len(blocks)]], time.time(), hits=1)
        return torch.stack(blocks, dim=2)  # [num_layers, 2, n, block_size, kv_heads, head_dim]

    def _drop_bad(self, entry: IndexedBlock, problem: str, missing: bool) -> None:
        dropped = False
        with self._guard():
            dropped = self._index().drop(entry.block_hash, entry.blob_path, missing)
        if dropped:  # otherwise another process pruned or rewrote it meanwhile: nothing is wrong
            self._warn(f"Dropped a bad prefix store entry ({problem}): {entry.blob_path}; its tokens are "
                       "recomputed.")

    def stored(self, hashes: Sequence[bytes]) -> set[bytes]:
        if self.disabled or not hashes:
            return set()
        with self._guard():
            return self._index().existing(hashes)
        return set()

    # --- writing ------------------------------------------------------------------------------
    def write_run(self, records: Sequence[BlockRecord], kv: torch.Tensor) -> int:
        """Store blocks not stored yet; kv is [num_layers, 2, len(records), block_size, kv_heads, head_dim]
        on the CPU. Returns the blocks written; prunes to the size cap afterwards."""
        if self.disabled or not records:
            return 0
        written = 0
        with self._guard():
            index = self._index()
            self.model_id = index.model_id(self.fingerprint, self.model_name)  # survives a reset elsewhere
            present = index.existing([r.block_hash for r in records])
            now = time.time()
            rows = [self._write_blob(r, kv[:, :, j], now) for j, r in enumerate(records)
                    if r.block_hash not in present]
            named = index.insert(rows)
            for row in rows:
                if named.get(row.block_hash, row.blob_path) != row.blob_path:  # another process stored it first
                    remove_blob(self.root, row.blob_path)
            index.touch([r.block_hash for r in records], now)
            written = len(rows)
            self.blocks_written += written
            self.bytes_written += sum(row.num_bytes for row in rows)
            if self.max_bytes is not None and index.total_bytes() > self.max_bytes:
                index.prune(self.max_bytes)
        return written

    def _write_blob(self, record: BlockRecord, kv: torch.Tensor, now: float) -> IndexedBlock:
        data = encode_block(kv, record.block_hash)
        digest = checksum(data)
        rel_path = blob_rel_path(self.model_id, record.block_hash, digest)
        write_atomic(self.root, rel_path, data)
        return IndexedBlock(
            block_hash=record.block_hash, parent_hash=record.parent_hash, model_id=self.model_id,
            depth=record.depth, num_tokens=len(record.token_ids), token_ids=encode_token_ids(record.token_ids),
            blob_path=rel_path, blob_offset=0, num_bytes=len(data), checksum=digest, created=now, last_used=now,
            hit_count=0,
        )
