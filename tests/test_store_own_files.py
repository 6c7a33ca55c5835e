"""The prefix store deletes only files it made, inside its own folder: an index row naming a path elsewhere
(absolute, `..`, any other shape) is dropped with its target untouched; `cache prune` and `cache clear`
leave files under `blobs/` that the store did not make alone."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.models.loader import load_model
from pagecli.store import maintenance
from pagecli.store.files import INDEX_NAME, blob_file, is_blob_rel_path, sweep_orphans

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. " * 3
OLD_S = 3600.0  # older than the sweep's grace for writes in flight


def make_engine(folder: Path, store: Path) -> Engine:
    config = EngineConfig(dtype="float32", device="cpu", attention="torch", block_size=BLOCK_SIZE, num_blocks=256,
                          disk_cache_dir=str(store))
    return Engine(config=config, loaded=load_model(folder, "float32", "cpu", max_positions=512))


@pytest.fixture()
def stored(tiny_llama, tmp_path) -> Path:
    """A store holding PROMPT's full blocks."""
    store = tmp_path / "store"
    engine = make_engine(tiny_llama, store)
    engine.generate([PROMPT], GREEDY)
    engine.persist_prefix(engine.encode(PROMPT))
    engine.close()
    return store


def rows(store: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(store / INDEX_NAME) as conn:
        return conn.execute("SELECT depth, blob_path FROM blocks ORDER BY depth").fetchall()


def point_row_at(store: Path, depth: int, blob_path: str) -> None:
    with sqlite3.connect(store / INDEX_NAME) as conn:
        conn.execute("UPDATE blocks SET blob_path = ? WHERE depth = ?", (blob_path, depth))


def age(path: Path) -> None:
    then = time.time() - OLD_S
    os.utime(path, (then, then))


@pytest.fixture()
def victim(tmp_path) -> Path:
    path = tmp_path / "someone-elses.txt"
    path.write_text("not the store's\n")
    return path


@pytest.mark.parametrize("how", ["absolute", "dot-dot"])
def test_a_row_naming_a_file_outside_the_store_is_dropped_and_the_file_left_alone(tiny_llama, stored, victim,
                                                                                 how):
    """Reproducer: such a row made a plain `generate` delete the file ("Dropped a bad prefix store entry")."""
    blob_path = str(victim) if how == "absolute" else "blobs/../../someone-elses.txt"
    point_row_at(stored, 1, blob_path)
    engine = make_engine(tiny_llama, stored)
    engine.generate([PROMPT], GREEDY)
    warnings = engine.take_warnings()
    engine.close()
    assert victim.read_text() == "not the store's\n"
    assert any("its blob path is not in the store" in w for w in warnings), warnings
    assert blob_path not in [path for _, path in rows(stored)], "the bad row is dropped"


def test_cache_clear_removes_rows_naming_outside_files_but_not_the_files(stored, victim):
    point_row_at(stored, 0, str(victim))
    point_row_at(stored, 1, "blobs/../../someone-elses.txt")
    maintenance.clear(stored, None, [])
    assert victim.read_text() == "not the store's\n"
    assert rows(stored) == []


def test_a_row_naming_another_file_inside_blobs_is_not_followed(tiny_llama, stored):
    """Only blob_rel_path's shape counts: a row naming another file under blobs/ is bad too."""
    notes = stored / "blobs" / "notes.txt"
    notes.write_text("mine\n")
    point_row_at(stored, 0, "blobs/notes.txt")
    maintenance.clear(stored, None, [])
    assert notes.read_text() == "mine\n"


def test_cache_prune_leaves_files_it_does_not_know_alone(stored):
    """Reproducer: `cache prune` deleted any file under blobs/ the index did not know, once 10 minutes old."""
    _, some_blob = rows(stored)[0]
    folder = (stored / some_blob).parent
    strangers = [stored / "blobs" / "README", folder / "notes.safetensors", folder / ("0" * 3)]
    for path in strangers:
        path.write_text("a user's file\n")
        age(path)
    maintenance.prune(stored, 1 << 40, [])
    maintenance.clear(stored, None, [])
    assert all(path.read_text() == "a user's file\n" for path in strangers)


def test_a_blob_a_crash_left_unindexed_is_still_swept(stored):
    """What the sweep is for: the store's own blob (by its name and its first bytes), no row naming it."""
    _, rel = rows(stored)[0]
    orphan = stored / rel
    with sqlite3.connect(stored / INDEX_NAME) as conn:
        conn.execute("DELETE FROM blocks WHERE blob_path = ?", (rel,))
    age(orphan)
    maintenance.prune(stored, 1 << 40, [])
    assert not orphan.exists()


def test_a_file_named_like_a_blob_that_is_not_one_is_left_alone(stored):
    _, rel = rows(stored)[0]
    impostor = stored / rel
    impostor.write_bytes(b"my own bytes under a blob's name")
    with sqlite3.connect(stored / INDEX_NAME) as conn:
        conn.execute("DELETE FROM blocks WHERE blob_path = ?", (rel,))
    age(impostor)
    maintenance.clear(stored, None, [])
    assert impostor.read_bytes() == b"my own bytes under a blob's name"


def test_a_symlinked_folder_under_blobs_is_never_entered(stored, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "00"
    elsewhere.mkdir(parents=True)
    _, rel = rows(stored)[0]
    copy = elsewhere / Path(rel).name
    shutil.copy(stored / rel, copy)
    age(copy)
    (stored / "blobs" / "999").symlink_to(elsewhere.parent)
    assert sweep_orphans(stored, set(), min_age_s=0.0)[0] >= 0
    assert copy.exists()
    assert blob_file(stored, f"blobs/999/00/{copy.name}") is None


@pytest.mark.parametrize("rel_path, ok", [
    ("blobs/1/ab/" + "ab" * 16 + "-" + "0" * 16 + ".safetensors", True),
    ("blobs/1/cd/" + "ab" * 16 + "-" + "0" * 16 + ".safetensors", False),
    ("/etc/passwd", False),
    ("blobs/../index.sqlite", False),
    ("blobs/1/ab/../../../x", False),
    ("blobs/1/ab/" + "ab" * 16 + "-" + "0" * 16 + ".safetensors/..", False),
    ("", False),
    (None, False),
])
def test_only_paths_of_the_stores_own_shape_are_its_blobs(rel_path, ok):
    assert is_blob_rel_path(rel_path) is ok
