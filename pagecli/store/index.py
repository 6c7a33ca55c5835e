"""The store's SQLite index: one row per stored KV block, one row per model fingerprint.

Invariants:
- a block row's hash is the engine's chained block hash, rooted in its model's fingerprint, so
  rows of different models never share a chain; lookups also filter on the model;
- a row is written only after its blob is complete on disk (temp file + rename), so every row
  names a whole file; a row whose blob is missing or fails its checksum is deleted on sight;
- blob files are deleted only while holding the write lock, and an insert checks under that lock
  that its files still exist, so a prune in one process never leaves another's row without a file;
- writes run in `BEGIN IMMEDIATE` transactions on a WAL database with a busy timeout, so
  several processes may read and write one store at once;
- every transaction that deletes block rows also adds to the `rows_deleted` count in `meta`, so
  a process that remembers which blocks are stored can tell when to ask again.
Each thread uses its own `StoreIndex` (sqlite3 connections are not shared across threads). A
connection keeps reading its file after that file is deleted or renamed, so `is_current` tells
whether the path still names the file it opened.
"""

from __future__ import annotations

import sqlite3
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagecli.paths import make_private_dir
from pagecli.store.files import INDEX_NAME, blob_file, remove_blob
from pagecli.store.pruning import plan_prune

SCHEMA_VERSION = "1"
BUSY_TIMEOUT_S = 30.0
_SQL_VARIABLES = 500  # hashes per IN (...) query, well under SQLite's limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (
    model_id INTEGER PRIMARY KEY,
    fingerprint TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    block_hash BLOB PRIMARY KEY,
    parent_hash BLOB NOT NULL,
    model_id INTEGER NOT NULL REFERENCES models(model_id),
    depth INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    blob_path TEXT NOT NULL,
    blob_offset INTEGER NOT NULL,
    num_bytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hit_count INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS blocks_by_parent ON blocks(parent_hash);
CREATE INDEX IF NOT EXISTS blocks_by_model ON blocks(model_id);
"""
_BLOCK_COLUMNS = ("block_hash, parent_hash, model_id, depth, num_tokens, token_ids, blob_path, blob_offset, "
                  "num_bytes, checksum, created, last_used, hit_count")


class StoreUnavailable(Exception):
    """The store cannot be used now (unwritable, disk full); the operation is skipped."""


class StoreLocked(StoreUnavailable):
    """Another process held the index past the busy timeout; waiting again would stall every request."""


class IndexCorrupt(Exception):
    """The index file is not a pagecli index (garbage, truncated, another schema)."""


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()  # int64, as the block hash reads them


@dataclass(frozen=True)
class IndexedBlock:
    block_hash: bytes
    parent_hash: bytes
    model_id: int
    depth: int  # the block's position in its chain (0: the first block of a prompt)
    num_tokens: int
    token_ids: bytes  # encode_token_ids of the block's tokens
    blob_path: str  # relative to the store directory
    blob_offset: int  # where the block starts in its blob file (one block per blob: always 0)
    num_bytes: int
    checksum: str  # sha256 of the whole blob file
    created: float
    last_used: float
    hit_count: int


@dataclass(frozen=True)
class ModelSummary:
    model_id: int
    name: str
    fingerprint: str
    entries: int
    num_bytes: int
    hits: int
    last_used: float | None


def _chunks(items: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(items), _SQL_VARIABLES):
        yield items[start : start + _SQL_VARIABLES]


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _file_identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


class StoreIndex:
    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path
        self.root = path.parent
        self.identity: tuple[int, int] | None = None  # the file this connection opened

    @classmethod
    def open(cls, root: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> StoreIndex:
        """Open (creating if needed) the index under root; IndexCorrupt if the file is not one of ours.
        A write waits up to busy_timeout_s for another process's transaction, then fails as locked."""
        make_private_dir(root)
        path = root / INDEX_NAME
        try:
            conn = sqlite3.connect(str(path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"cannot open the prefix store index {path}: {exc}") from exc
        try:
            with translate_errors(path):
                conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                index = cls(conn, path)
                _retry_while_locked(index._set_up, time.monotonic() + busy_timeout_s)
            index.identity = _file_identity(path)
            return index
        except BaseException:
            conn.close()
            raise

    def _set_up(self) -> None:
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")  # with WAL: a crash may lose recent rows, not consistency
        self._ensure_schema()

    def _ensure_schema(self) -> None:
        version = self._schema_version()
        if version is None:
            with self.write():
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self.conn.execute(statement)
                self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
            version = self._schema_version()
        if version != SCHEMA_VERSION:
            raise IndexCorrupt(f"{self.path} has schema version {version!r}, not {SCHEMA_VERSION}")

    def _schema_version(self) -> str | None:
        has_meta = self.conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        if not has_meta:
            tables = self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if tables:
                raise IndexCorrupt(f"{self.path} is an SQLite file of something else")
            return None
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return row[0] if row else None

    def close(self) -> None:
        self.conn.close()

    def is_current(self) -> bool:
        """Whether the index path still names the file this connection opened (not deleted or replaced)."""
        return self.identity is not None and _file_identity(self.path) == self.identity

    @contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction; taking the write lock first avoids deadlocked upgrades."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # --- models -------------------------------------------------------------------------------
    def model_id(self, fingerprint: str, name: str) -> int:
        """The model's id, registering the model (and its name) first if needed."""
        row = self.conn.execute("SELECT model_id, name FROM models WHERE fingerprint = ?", (fingerprint,)).fetchone()
        if row is not None and row[1] == name:
            return int(row[0])  # a read: works on an index that cannot be written
        with self.write():
            self.conn.execute("INSERT OR IGNORE INTO models (fingerprint, name, created) VALUES (?, ?, ?)",
                              (fingerprint, name, time.time()))
            self.conn.execute("UPDATE models SET name = ? WHERE fingerprint = ?", (name, fingerprint))
            row = self.conn.execute("SELECT model_id FROM models WHERE fingerprint = ?", (fingerprint,)).fetchone()
        return int(row[0])

    def model_summaries(self) -> list[ModelSummary]:
        rows = self.conn.execute(
            "SELECT m.model_id, m.name, m.fingerprint, count(b.block_hash), coalesce(sum(b.num_bytes), 0), "
            "coalesce(sum(b.hit_count), 0), max(b.last_used) FROM models m "
            "LEFT JOIN blocks b ON b.model_id = m.model_id GROUP BY m.model_id ORDER BY m.model_id"
        ).fetchall()
        return [ModelSummary(*row) for row in rows]

    def delete_models(self, model_ids: Iterable[int]) -> int:
        """Delete some models with their blocks and blobs; returns the number of blocks deleted."""
        deleted = 0
        with self.write():
            for model_id in model_ids:
                paths = [r[0] for r in self.conn.execute("SELECT blob_path FROM blocks WHERE model_id = ?",
                                                         (model_id,))]
                self.conn.execute("DELETE FROM blocks WHERE model_id = ?", (model_id,))
                self.conn.execute("DELETE FROM models WHERE model_id = ?", (model_id,))
                self._count_deleted(len(paths))
                self._remove_blobs(paths)
                deleted += len(paths)
        return deleted

    def rows_deleted(self) -> int:
        """How many block rows were ever deleted from this index (an index without the count: 0)."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'rows_deleted'").fetchone()
        return int(row[0]) if row else 0

    def _count_deleted(self, num_rows: int) -> None:
        """Called inside the write transaction that deleted the rows."""
        if num_rows:
            self.conn.execute(
                "INSERT INTO meta VALUES ('rows_deleted', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + excluded.value", (str(num_rows),))

    def _remove_blobs(self, paths: Iterable[str]) -> None:
        """Delete blob files; called inside a write transaction (see the invariants). A path that is not
        the store's own (files.blob_file) is left alone: only its row goes."""
        for rel_path in paths:
            remove_blob(self.root, rel_path)

    # --- blocks -------------------------------------------------------------------------------
    def blocks(self, model_id: int, hashes: Sequence[bytes]) -> dict[bytes, IndexedBlock]:
        found: dict[bytes, IndexedBlock] = {}
        for chunk in _chunks(hashes):
            rows = self.conn.execute(
                f"SELECT {_BLOCK_COLUMNS} FROM blocks WHERE model_id = ? AND block_hash IN ({_marks(len(chunk))})",
                (model_id, *chunk),
            )
            found.update((row[0], IndexedBlock(*row)) for row in rows)
        return found

    def blob_paths(self, hashes: Sequence[bytes]) -> dict[bytes, str]:
        """The blob path of each of these hashes the index has a row for."""
        found: dict[bytes, str] = {}
        for chunk in _chunks(hashes):
            rows = self.conn.execute(
                f"SELECT block_hash, blob_path FROM blocks WHERE block_hash IN ({_marks(len(chunk))})", tuple(chunk))
            found.update((row[0], row[1]) for row in rows)
        return found

    def insert(self, blocks: Sequence[IndexedBlock]) -> dict[bytes, str]:
        """Insert rows whose blobs are on disk (first writer wins); returns, per hash, the blob path
        the index now names. A row whose file a concurrent prune removed meanwhile is not kept, nor
        one whose parent block is not stored (a concurrent prune took it after the writer saw it):
        a stored chain always starts at a prompt's first block. Parents come before children."""
        named: dict[bytes, str] = {}
        with self.write():
            for b in blocks:
                if not (self.root / b.blob_path).is_file():
                    continue
                if b.depth > 0 and self.conn.execute("SELECT 1 FROM blocks WHERE block_hash = ?",
                                                     (b.parent_hash,)).fetchone() is None:
                    continue
                self.conn.execute(
                    f"INSERT OR IGNORE INTO blocks ({_BLOCK_COLUMNS}) VALUES ({_marks(13)})",
                    (b.block_hash, b.parent_hash, b.model_id, b.depth, b.num_tokens, b.token_ids, b.blob_path,
                     b.blob_offset, b.num_bytes, b.checksum, b.created, b.last_used, b.hit_count),
                )
                row = self.conn.execute("SELECT blob_path FROM blocks WHERE block_hash = ?", (b.block_hash,)).fetchone()
                named[b.block_hash] = row[0]
        return named

    def remove_unnamed_blobs(self, paths: Iterable[str]) -> None:
        """Delete those of these blob files that no row names (the leftovers of a failed write)."""
        with self.write():
            for rel_path in paths:
                if self.conn.execute("SELECT 1 FROM blocks WHERE blob_path = ?", (rel_path,)).fetchone() is None:
                    remove_blob(self.root, rel_path)

    def touch(self, hashes: Sequence[bytes], now: float, hits: int = 0) -> None:
        with self.write():
            for chunk in _chunks(hashes):
                self.conn.execute(
                    f"UPDATE blocks SET last_used = max(last_used, ?), hit_count = hit_count + ? "
                    f"WHERE block_hash IN ({_marks(len(chunk))})",
                    (now, hits, *chunk),
                )

    def drop(self, block_hash: bytes, blob_path: str, missing: bool) -> bool:
        """Delete the row of a bad blob (and the blob); False if there was nothing to drop: the row
        is gone (pruned meanwhile), or a blob reported missing is back (written again meanwhile)."""
        with self.write():
            path = blob_file(self.root, blob_path)  # None: a path outside the store, never looked at
            if missing and path is not None and path.is_file():
                return False
            cursor = self.conn.execute("DELETE FROM blocks WHERE block_hash = ? AND blob_path = ?",
                                       (block_hash, blob_path))
            if cursor.rowcount:
                self._count_deleted(cursor.rowcount)
                self._remove_blobs([blob_path])
        return cursor.rowcount > 0

    def prune(self, max_bytes: int) -> int:
        """Delete least recently used chain tails (rows and blobs) until the blocks total at most
        max_bytes; returns how many blocks went. Plans and deletes in one transaction, so a
        concurrent writer cannot extend a chain whose tail is being removed."""
        with self.write():
            rows = self.conn.execute("SELECT block_hash, parent_hash, last_used, depth, num_bytes FROM blocks")
            doomed = plan_prune(rows.fetchall(), max_bytes)
            for chunk in _chunks(doomed):
                marks = _marks(len(chunk))
                paths = [r[0] for r in self.conn.execute(
                    f"SELECT blob_path FROM blocks WHERE block_hash IN ({marks})", tuple(chunk))]
                self.conn.execute(f"DELETE FROM blocks WHERE block_hash IN ({marks})", tuple(chunk))
                self._count_deleted(len(paths))
                self._remove_blobs(paths)
        return len(doomed)

    def total_bytes(self) -> int:
        return int(self.conn.execute("SELECT coalesce(sum(num_bytes), 0) FROM blocks").fetchone()[0])

    def indexed_paths(self) -> set[str]:
        return {row[0] for row in self.conn.execute("SELECT blob_path FROM blocks")}

    def all_blocks(self) -> list[IndexedBlock]:
        return [IndexedBlock(*row) for row in self.conn.execute(f"SELECT {_BLOCK_COLUMNS} FROM blocks")]

    def integrity_ok(self, quick: bool = False) -> bool:
        """SQLite's own check of every page; quick_check skips comparing indexes with their tables."""
        with translate_errors(self.path):
            return self.conn.execute(f"PRAGMA {'quick_check' if quick else 'integrity_check'}").fetchone()[0] == "ok"


@contextmanager
def translate_errors(path: Path) -> Iterator[None]:
    """sqlite3 errors as the store's two kinds: a corrupt index, or a store unavailable for now."""
    try:
        yield
    except sqlite3.OperationalError as exc:  # locked past the timeout, read-only, disk full, ...
        kind = StoreLocked if "locked" in str(exc) else StoreUnavailable
        raise kind(f"the prefix store index {path} cannot be used now: {exc}") from exc
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        raise IndexCorrupt(f"{path}: {exc}") from exc



def _retry_while_locked(step: Callable[[], None], deadline: float) -> None:
    """Run step, again while another connection holds the lock, until the deadline.

    SQLite waits out a held lock with the busy timeout, except where waiting could deadlock: two
    connections that both read the file and then both need its write lock (switching a new index to
    WAL, creating the schema). There it answers "database is locked" at once, so we wait here."""
    pause = 0.005
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An advisory lock between processes (POSIX); elsewhere, no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def reset_index(root: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> StoreIndex:
    """Replace a corrupt index by an empty one (keeping the bad file as index.sqlite.corrupt).

    Under a lock, and only if the index is still corrupt: another process may have reset it first.
    An index whose schema reads but whose pages do not (a truncated file) counts as corrupt.
    Blobs the old index named become orphans, which pruning sweeps once they are old.
    """
    make_private_dir(root)
    with _exclusive_lock(root / ".index.lock"):
        try:
            index = StoreIndex.open(root, busy_timeout_s)
            if index.integrity_ok(quick=True):
                return index
            index.close()
        except IndexCorrupt:
            pass
        path = root / INDEX_NAME
        path.replace(path.with_name(INDEX_NAME + ".corrupt"))
        for suffix in ("-wal", "-shm"):
            path.with_name(INDEX_NAME + suffix).unlink(missing_ok=True)
        return StoreIndex.open(root, busy_timeout_s)


def open_index(root: Path, warn: Callable[[str], None], busy_timeout_s: float = BUSY_TIMEOUT_S) -> StoreIndex:
    """The index under root; a corrupt one is replaced by an empty one, with one warning."""
    try:
        return StoreIndex.open(root, busy_timeout_s)
    except IndexCorrupt as exc:
        warn(f"The prefix store index was unreadable ({exc}); started an empty one. Cached prefixes are "
             "recomputed as needed.")
        return reset_index(root, busy_timeout_s)
