"""Disk prefix store faults while an engine runs: damaged blobs and index, a full or read-only disk.

Every case keeps one engine alive across the fault. Greedy output must equal a run without a
store, each kind of fault is reported once (not per block or per request), and once the fault is
gone the store works again: the damaged entries are gone, later writes land, and the index names
exactly the files on disk (`maintenance.check`).
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import pytest
import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model
from pagecli.store import files, maintenance
from pagecli.store.files import INDEX_NAME
from pagecli.store.index import StoreIndex
from pagecli.store.prefix_store import BlockRecord
from pagecli.store.writer import BackgroundWriter
from test_disk_store import _blob_at_depth as blob_at_depth
from test_disk_store import _stored_depths as stored_depths

BLOCK_SIZE = 4
NUM_BLOCKS = 37  # FILLER's 37 blocks push every block of PROMPT out of the pool
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SYSTEM = "Paged attention keeps the KV cache in fixed-size blocks. " * 4
PROMPT = SYSTEM + "The quick brown fox jumps over the lazy dog."
OTHER = "Hello world! How are you today? " * 3
FILLER = "def main():\n    print('hello')\n" * 13


def make_engine(folder: Path, store: Path, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "block_size": BLOCK_SIZE,
                "num_blocks": NUM_BLOCKS, "disk_cache_dir": str(store), **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


@pytest.fixture()
def store(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="module")
def expected(tiny_llama, tmp_path_factory) -> dict[str, tuple[int, ...]]:
    """Greedy tokens of each prompt from an engine without a store."""
    engine = make_engine(tiny_llama, tmp_path_factory.mktemp("unused"), disk_cache=False)
    return {p: engine.generate([p], GREEDY)[0].token_ids for p in (PROMPT, OTHER)}


def full_blocks(engine: Engine, prompt: str) -> int:
    return len(engine.encode(prompt)) // BLOCK_SIZE


def served_blocks(engine: Engine, prompt: str) -> int:
    """Blocks a prefix hit can serve: all full blocks but one holding the last token."""
    return (len(engine.encode(prompt)) - 1) // BLOCK_SIZE


def persist(engine: Engine, prompt: str) -> int:
    """What chat does after a turn: write the prompt's full blocks, then wait for the writer."""
    queued = engine.persist_prefix(engine.encode(prompt))
    engine.flush_disk_writes()
    return queued


def evict(engine: Engine, prompt: str = PROMPT) -> None:
    """Push the prompt's blocks out of the pool, so the next request for it reads the store."""
    engine.generate([FILLER], GREEDY)
    assert engine.kv.cached_prefix(engine.encode(prompt)) == []


def disk_hits_of(engine: Engine, prompt: str) -> tuple[tuple[int, ...], int]:
    """(tokens, tokens served from disk) of one request."""
    before = engine.stats().prefix_disk_hit_tokens
    out = engine.generate([prompt], GREEDY)[0]
    return out.token_ids, engine.stats().prefix_disk_hit_tokens - before


def assert_consistent(store: Path) -> None:
    """Every row names an intact blob, every blob has a row, and every chain starts at its head."""
    assert maintenance.check(store) == []
    with sqlite3.connect(store / INDEX_NAME) as conn:
        rows = conn.execute("SELECT block_hash, parent_hash, depth FROM blocks").fetchall()
    stored = {r[0] for r in rows}
    assert all(depth == 0 or parent in stored for _, parent, depth in rows)


# --- damaged blobs ---------------------------------------------------------------------------------
def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100:-90] = bytes(b ^ 0xFF for b in data[-100:-90])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(1000)


def delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("damage", [flip_bytes, truncate, delete],
                         ids=["flipped bytes", "truncated blob", "deleted blob"])
def test_a_blob_damaged_while_the_engine_runs_is_dropped_reported_once_and_written_again(
        damage, tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    assert persist(engine, PROMPT) == full_blocks(engine, PROMPT)
    evict(engine)
    damage(blob_at_depth(store, 3))

    assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], 3 * BLOCK_SIZE)  # the blocks before the bad one
    assert len(engine.take_warnings()) == 1
    assert persist(engine, PROMPT) == 1, "the dropped block is written again, the others are still stored"
    assert stored_depths(store, engine, PROMPT) == list(range(full_blocks(engine, PROMPT)))
    evict(engine)
    assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], served_blocks(engine, PROMPT) * BLOCK_SIZE)
    assert engine.take_warnings() == []
    engine.close()
    assert_consistent(store)


def test_the_blobs_folder_deleted_while_the_engine_runs_gives_one_warning_and_is_written_again(
        tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    for prompt in (PROMPT, OTHER):
        engine.generate([prompt], GREEDY)
        persist(engine, prompt)
    shutil.rmtree(store / files.BLOBS_DIR)

    for _ in range(3):
        evict(engine)
        assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], 0)
        assert disk_hits_of(engine, OTHER) == (expected[OTHER], 0)
    assert len(engine.take_warnings()) == 1, "one warning for the store, not one per bad block or request"
    for prompt in (PROMPT, OTHER):
        assert persist(engine, prompt) == full_blocks(engine, prompt), "rows without a file are not 'stored'"
    engine.close()
    assert_consistent(store)
    fresh = make_engine(tiny_llama, store)
    assert disk_hits_of(fresh, PROMPT) == (expected[PROMPT], served_blocks(fresh, PROMPT) * BLOCK_SIZE)
    assert fresh.take_warnings() == []


def test_every_blob_altered_gives_one_warning_and_each_bad_entry_read_is_dropped(tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    persist(engine, PROMPT)
    for i, path in enumerate(sorted((store / files.BLOBS_DIR).rglob("*.safetensors"))):
        (flip_bytes, truncate)[i % 2](path)

    for round in range(3):
        evict(engine)
        assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], round * BLOCK_SIZE)  # up to the bad block
        assert len(stored_depths(store, engine, PROMPT)) == full_blocks(engine, PROMPT) - 1, "it is dropped"
        assert persist(engine, PROMPT) == 1, "and written again: the next read gets one block further"
    assert len(engine.take_warnings()) == 1


def test_blocks_pruned_by_another_process_are_written_again_when_the_conversation_grows(tiny_llama, store):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    persist(engine, PROMPT)
    total = maintenance.store_stats(store, []).num_bytes
    maintenance.prune(store, total // 2, [])  # `pagecli cache prune` in another shell: the chain loses its tail
    assert 0 < len(stored_depths(store, engine, PROMPT)) < full_blocks(engine, PROMPT)

    longer = PROMPT + " Hello world!"
    engine.generate([longer], GREEDY)
    persist(engine, longer)
    engine.close()
    assert stored_depths(store, engine, longer) == list(range(full_blocks(engine, longer))), "no gap in the chain"
    assert_consistent(store)


# --- a damaged index --------------------------------------------------------------------------------
def checkpoint(store: Path) -> None:
    """Move the index's rows from the WAL into the main file, as SQLite does every 1,000 pages."""
    with closing(sqlite3.connect(store / INDEX_NAME)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def garbage_index(store: Path) -> None:
    path = store / INDEX_NAME
    path.write_bytes(os.urandom(path.stat().st_size))


def truncate_index(store: Path) -> None:
    path = store / INDEX_NAME
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)


def delete_index(store: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (store / (INDEX_NAME + suffix)).unlink(missing_ok=True)


def delete_blobs(store: Path) -> None:
    shutil.rmtree(store / files.BLOBS_DIR)


def assert_consistent_but_for_orphans(store: Path) -> None:
    """assert_consistent, except for blobs a replaced index no longer names (`cache prune` sweeps them)."""
    assert [p for p in maintenance.check(store) if not p.startswith("unindexed file")] == []


INDEX_DAMAGE = pytest.mark.parametrize("damage", [garbage_index, truncate_index, delete_index],
                                       ids=["garbage index", "truncated index", "deleted index"])


@INDEX_DAMAGE
def test_an_index_damaged_while_the_engine_runs_is_replaced_once_and_later_writes_land_in_the_new_one(
        damage, tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    persist(engine, PROMPT)
    evict(engine)
    checkpoint(store)
    damage(store)

    assert disk_hits_of(engine, PROMPT)[0] == expected[PROMPT]
    assert engine.generate([OTHER], GREEDY)[0].token_ids == expected[OTHER]
    assert persist(engine, OTHER) == full_blocks(engine, OTHER)
    persist(engine, PROMPT)
    assert len(engine.take_warnings()) == 1
    engine.close()
    assert_consistent_but_for_orphans(store)
    fresh = make_engine(tiny_llama, store)
    for prompt in (PROMPT, OTHER):
        assert disk_hits_of(fresh, prompt) == (expected[prompt], served_blocks(fresh, prompt) * BLOCK_SIZE)
    assert fresh.take_warnings() == []


@pytest.mark.parametrize("damage", [garbage_index, delete_index, delete_blobs],
                         ids=["garbage index", "deleted index", "deleted blobs folder"])
def test_damage_while_writes_are_queued_loses_no_later_write(damage, tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    engine.generate([OTHER], GREEDY)
    persist(engine, OTHER)
    gate = threading.Event()
    write_run = engine.disk.store.write_run
    engine.disk.store.write_run = lambda *args: (gate.wait(), write_run(*args))[1]  # a slow disk
    engine.generate([PROMPT], GREEDY)
    assert engine.persist_prefix(engine.encode(PROMPT)) == full_blocks(engine, PROMPT)  # queued, not written
    checkpoint(store)
    damage(store)
    gate.set()
    engine.flush_disk_writes()

    for prompt in (PROMPT, OTHER):
        engine.generate([prompt], GREEDY)
        persist(engine, prompt)  # what the next chat turn does: whatever the store lacks is written
        evict(engine, prompt)
        assert disk_hits_of(engine, prompt) == (expected[prompt], served_blocks(engine, prompt) * BLOCK_SIZE)
    assert len(engine.take_warnings()) == 1
    engine.close()
    assert_consistent_but_for_orphans(store)


# --- a full or read-only disk -------------------------------------------------------------------------
class FaultyDisk:
    """Stands in for `os` in pagecli.store.files: once `fail()` is called, blob writes fail with an
    errno, after `blobs_before` more blobs have been written (the disk fills up in mid-run)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.writes_left: int | None = None  # None: no fault

    def __getattr__(self, name: str):
        return getattr(os, name)

    def fail(self, blobs_before: int = 0) -> None:
        self.writes_left = blobs_before

    def heal(self) -> None:
        self.writes_left = None

    def _faulty(self) -> bool:
        if self.writes_left is None:
            return False
        self.writes_left -= 1
        return self.writes_left < 0

    def open(self, path, flags, mode=0o777):
        if self.error != errno.ENOSPC and self._faulty():
            raise OSError(self.error, os.strerror(self.error), str(path))
        return os.open(path, flags, mode)

    def fdopen(self, fd, *args, **kwargs):
        handle = os.fdopen(fd, *args, **kwargs)
        return _FillingFile(handle, self.error) if self.error == errno.ENOSPC and self._faulty() else handle


class _FillingFile:
    """A file on a disk that fills up: half the data lands, then ENOSPC."""

    def __init__(self, handle, error: int) -> None:
        self.handle = handle
        self.error = error

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.handle.close()

    def write(self, data: bytes) -> int:
        self.handle.write(data[: len(data) // 2])
        raise OSError(self.error, os.strerror(self.error))


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=["disk full", "read-only", "no access"])
def test_a_full_or_read_only_disk_skips_writes_with_one_warning_and_writes_again_once_it_is_gone(
        error, tiny_llama, store, expected, monkeypatch):
    engine = make_engine(tiny_llama, store)
    disk = FaultyDisk(error)
    monkeypatch.setattr(files, "os", disk)
    disk.fail(blobs_before=5)  # the disk fills up in the middle of the first run of blocks
    for prompt in (PROMPT, OTHER, PROMPT + " Again.", OTHER + " Again."):
        engine.generate([prompt], GREEDY)
        persist(engine, prompt)
    evict(engine)
    assert [engine.generate([p], GREEDY)[0].token_ids for p in (PROMPT, OTHER)] == [expected[PROMPT], expected[OTHER]]
    assert len(engine.take_warnings()) == 1, "one warning while the disk is full, not one per write"
    assert maintenance.list_models(store, [])[0].entries == 0, "a failed run of blocks leaves nothing behind"
    assert_consistent(store)

    disk.heal()
    for prompt in (PROMPT, OTHER):
        assert persist(engine, prompt) == full_blocks(engine, prompt)
    assert engine.take_warnings() == []
    engine.close()
    assert_consistent(store)
    fresh = make_engine(tiny_llama, store)
    for prompt in (PROMPT, OTHER):
        assert disk_hits_of(fresh, prompt) == (expected[prompt], served_blocks(fresh, prompt) * BLOCK_SIZE)


def test_an_index_that_cannot_be_written_keeps_reads_going_and_recovers(tiny_llama, store, expected, monkeypatch):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    persist(engine, PROMPT)
    evict(engine)
    full = True
    for name in ("insert", "touch"):  # the writes that grow or change rows; a full disk fails them
        def failing(self, *args, _real=getattr(StoreIndex, name), **kwargs):
            if full:
                raise sqlite3.OperationalError("database or disk is full")
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(StoreIndex, name, failing)

    served = served_blocks(engine, PROMPT) * BLOCK_SIZE
    assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], served), "a read needs no write"
    for prompt in (OTHER, OTHER + " Again."):
        engine.generate([prompt], GREEDY)
        persist(engine, prompt)
    evict(engine)
    assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], served)
    assert len(engine.take_warnings()) == 1
    # A request that finishes after a disk hit queues its prompt's write (the automatic policy): wait for it, or
    # its blob may still be on its way out when the check looks (a race CI met once).
    engine.flush_disk_writes()
    assert_consistent(store)  # the blobs of the runs whose rows failed are gone

    full = False
    engine.generate([OTHER], GREEDY)
    assert persist(engine, OTHER) == full_blocks(engine, OTHER)
    engine.close()
    assert stored_depths(store, engine, OTHER) == list(range(full_blocks(engine, OTHER)))
    assert_consistent(store)


def _set_modes(folder: Path, dir_mode: int) -> None:
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir():
            path.chmod(dir_mode)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may create files in a read-only directory")
def test_a_store_directory_made_read_only_while_the_engine_runs_skips_writes_and_recovers(
        tiny_llama, store, expected):
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    persist(engine, PROMPT)
    _set_modes(store, 0o500)  # no new files: neither blobs nor temp files
    try:
        engine.generate([OTHER], GREEDY)
        persist(engine, OTHER)
        engine.generate([OTHER + " Again."], GREEDY)
        persist(engine, OTHER + " Again.")
        evict(engine)
        assert disk_hits_of(engine, PROMPT) == (expected[PROMPT], served_blocks(engine, PROMPT) * BLOCK_SIZE)
        assert len(engine.take_warnings()) == 1
    finally:
        _set_modes(store, 0o700)
    engine.generate([OTHER], GREEDY)
    assert persist(engine, OTHER) == full_blocks(engine, OTHER)
    engine.close()
    assert_consistent(store)


def test_a_writer_closed_from_its_own_thread_finishes_the_queue_then_closes_the_store():
    # Garbage collection can run the disk tier's finalizer on the writer thread, in the middle of a
    # write. Joining itself raised "cannot join current thread", and the store was closed under
    # the write in progress.
    events: list[str] = []
    queued = threading.Event()

    class Store:
        def write_run(self, records, kv):
            name = records[0].block_hash.decode()
            if name == "first":
                queued.wait(5)
                writer.close(then=lambda: events.append("store closed"))  # as the finalizer would
            events.append(f"wrote {name}")

    warnings: list[str] = []
    writer = BackgroundWriter(Store(), warnings.append)
    writer.submit([BlockRecord(b"first", None, 0, (1,))], torch.zeros(1))
    writer.submit([BlockRecord(b"second", None, 0, (1,))], torch.zeros(1))  # queued before the close
    queued.set()
    writer._thread.join(5)
    assert not writer._thread.is_alive()
    assert events == ["wrote first", "wrote second", "store closed"]
    assert warnings == []
