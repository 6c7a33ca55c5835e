"""One model's view of a prefix store directory: find, read and write runs of KV blocks.

Nothing here raises into the engine, and a fault does not turn the store off for good:
- a bad blob (missing, truncated, altered) is dropped from the index when a read meets it, and
  so is a row naming a path that is not the store's own (files.blob_file: its target is never
  opened or removed); and
  a row whose blob file is gone is dropped when a write asks whether the block is stored, so
  the next persist writes the block again;
- a corrupt index is moved aside and an empty one started; an index deleted or replaced while
  the process runs is noticed at the next access and opened anew;
- a write that fails (disk full, read-only, the index unwritable) is skipped and its blobs are
  removed; the next write tries again;
- only a lock held past the busy timeout turns the store off for the rest of the process, since
  every later access would wait that long again.
Each kind of problem is reported once through `warn` (a failing disk once until a write works
again), not once per block or request. Each thread gets its own SQLite connection.
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
from pagecli.store.files import blob_file, blob_rel_path, checksum, remove_blob, write_atomic
from pagecli.store.index import (
    IndexCorrupt, IndexedBlock, StoreIndex, StoreLocked, StoreUnavailable, encode_token_ids, open_index, reset_index,
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
        self.bad_entries_dropped = 0
        self._warn = warn
        self._failing = False  # an operation failed and no write has worked since; reported once
        self._local = threading.local()
        self._generation = 0  # bumped when the index is replaced, so every thread reopens it
        self._lock = threading.Lock()
        self._connections: list[StoreIndex] = []
        self.model_id = 0
        try:
            with translate_errors(root):
                self._index()  # registers the model: sets model_id
        except (StoreUnavailable, IndexCorrupt, OSError) as exc:
            self.close()
            warn(f"The disk prefix store is off for this run: {exc}")
            raise StoreUnavailable(f"the prefix store in {root} cannot be used") from exc

    # --- connections and failures -------------------------------------------------------------
    def _index(self) -> StoreIndex:
        local = self._local
        if getattr(local, "generation", None) == self._generation and local.index.is_current():
            return local.index
        with self._lock:
            if getattr(local, "generation", None) == self._generation:  # deleted or replaced under us
                self._generation += 1
                self._warn(f"The prefix store index {local.index.path} was deleted or replaced while pagecli ran; "
                           "using the one there now. Prefixes it does not hold are recomputed as needed.")
            local.index = open_index(self.root, self._warn)
            local.generation = self._generation
            self._connections.append(local.index)
            self.model_id = local.index.model_id(self.fingerprint, self.model_name)
        return local.index

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn store failures into warnings: a corrupt index is replaced, a failed operation skipped."""
        try:
            with translate_errors(self.root):
                yield
        except IndexCorrupt as exc:
            self._replace_index(exc)
        except StoreLocked as exc:
            self.disabled = True
            self._warn(f"The disk prefix store is off for this run: {exc}")
        except (StoreUnavailable, OSError) as exc:
            self._report_failure(exc)

    def _report_failure(self, exc: Exception) -> None:
        with self._lock:
            first = not self._failing
            self._failing = True
        if first:
            self._warn(f"The disk prefix store cannot be used now ({exc}); prefixes are computed as usual and "
                       "saved again once it works.")

    def _replace_index(self, problem: IndexCorrupt) -> None:
        """Move the corrupt index aside for an empty one; every thread opens the new one at its next access."""
        with self._lock:
            if getattr(self._local, "generation", None) != self._generation:
                return  # another thread replaced it meanwhile
            self._generation += 1
        try:
            with translate_errors(self.root):
                reset_index(self.root).close()
        except (StoreUnavailable, IndexCorrupt, OSError) as exc:
            self._report_failure(exc)
            return
        self._warn(f"The prefix store index broke ({problem}); started an empty one. Cached prefixes are "
                   "recomputed as needed.")

    def close(self) -> None:
        with self._lock:
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
            path = blob_file(self.root, entry.blob_path)
            if path is None:  # a row naming a file outside the store: dropped, the file never opened
                self._drop_bad(entry, "its blob path is not in the store", missing=False)
                break
            try:
                data = path.read_bytes()
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
            self._count_bad_entry(problem, entry.blob_path)

    def _count_bad_entry(self, problem: str, blob_path: str) -> None:
        self.bad_entries_dropped += 1
        if self.bad_entries_dropped == 1:
            self._warn(f"Dropped a bad prefix store entry ({problem}): {blob_path}; its tokens are recomputed. "
                       "Further bad entries are dropped without a message.")

    def deletion_mark(self) -> tuple[int, int] | None:
        """Changes whenever a stored block may have gone (a row deleted by any process, or the index
        replaced); None if the index cannot be read now."""
        if self.disabled:
            return None
        with self._guard():
            rows_deleted = self._index().rows_deleted()
            return self._generation, rows_deleted
        return None

    def stored(self, hashes: Sequence[bytes]) -> set[bytes]:
        """The hashes the store holds with their blob file on disk."""
        if self.disabled or not hashes:
            return set()
        with self._guard():
            return self._present(self._index(), hashes)
        return set()

    def _present(self, index: StoreIndex, hashes: Sequence[bytes]) -> set[bytes]:
        """The hashes index has a row for whose blob file exists; a row whose file is gone is dropped, so
        the block counts as not stored and is written again."""
        present: set[bytes] = set()
        for block_hash, blob_path in index.blob_paths(hashes).items():
            path = blob_file(self.root, blob_path)
            if path is not None and path.is_file():
                present.add(block_hash)
            elif index.drop(block_hash, blob_path, missing=True):
                self._count_bad_entry("its blob file is missing", blob_path)
        return present

    # --- writing ------------------------------------------------------------------------------
    def write_run(self, records: Sequence[BlockRecord], kv: torch.Tensor) -> int:
        """Store blocks not stored yet; kv is [num_layers, 2, len(records), block_size, kv_heads, head_dim]
        on the CPU. Returns the blocks written; prunes to the size cap afterwards. A run that fails
        leaves no blob behind."""
        if self.disabled or not records:
            return 0
        written = 0
        with self._guard():
            index = self._index()
            self.model_id = index.model_id(self.fingerprint, self.model_name)  # survives a reset elsewhere
            present = self._present(index, [r.block_hash for r in records])
            now = time.time()
            rows = self._write_new_blocks(index, records, kv, present, now)
            index.touch([r.block_hash for r in records], now)
            written = len(rows)
            self.blocks_written += written
            self.bytes_written += sum(row.num_bytes for row in rows)
            if self.max_bytes is not None and index.total_bytes() > self.max_bytes:
                index.prune(self.max_bytes)
            with self._lock:
                self._failing = False  # a write worked: the next failure is news again
        return written

    def _write_new_blocks(self, index: StoreIndex, records: Sequence[BlockRecord], kv: torch.Tensor,
                          present: set[bytes], now: float) -> list[IndexedBlock]:
        """Write the blobs of the records not present and index them; on a failure remove the blobs written."""
        rows: list[IndexedBlock] = []
        try:
            for j, record in enumerate(records):
                if record.block_hash not in present:
                    rows.append(self._write_blob(record, kv[:, :, j], now))
            named = index.insert(rows)
        except BaseException:
            self._remove_unnamed(index, rows)
            raise
        kept = []
        for row in rows:
            if named.get(row.block_hash) == row.blob_path:
                kept.append(row)
            else:  # another process stored it first, or its parent was pruned meanwhile
                remove_blob(self.root, row.blob_path)
        return kept

    def _remove_unnamed(self, index: StoreIndex, rows: Sequence[IndexedBlock]) -> None:
        try:
            with translate_errors(self.root):
                index.remove_unnamed_blobs([row.blob_path for row in rows])
        except (StoreUnavailable, IndexCorrupt, OSError):
            pass  # left as orphans, which `pagecli cache prune` sweeps

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
