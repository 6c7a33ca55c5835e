"""What `pagecli cache` does to a store directory: list, summarize, clear, prune, check.

Works on the index and the files only (no torch, no model). Reading commands never create
a store that does not exist yet. Every failure of the store itself (read-only, in use by
another process, unreadable) is a PagecliError saying which store and what to do.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pagecli.errors import PagecliError
from pagecli.store.files import INDEX_NAME, blob_file, checksum_file, iter_blob_files, sweep_orphans
from pagecli.store.index import (
    IndexCorrupt, ModelSummary, StoreIndex, StoreLocked, StoreUnavailable, open_index, translate_errors,
)

# A running engine's writes take milliseconds; a command that waited the engine's 30 s for one
# held longer would look hung, so it says the store is busy instead.
MAINTENANCE_BUSY_TIMEOUT_S = 3.0
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class ModelEntry:
    """One model's share of the store, as `cache ls` shows it."""

    model_id: int
    name: str
    fingerprint_id: str  # a short digest of the full fingerprint
    kv_dtype: str
    block_size: int | None
    entries: int
    num_bytes: int
    hits: int
    last_used: float | None


@dataclass(frozen=True)
class StoreStats:
    directory: str
    exists: bool
    models: int
    entries: int
    num_bytes: int  # bytes of the indexed blobs
    disk_bytes: int  # everything in the directory: index, blobs, leftovers
    hits: int
    unindexed_files: int  # blobs no row names (a crash mid-write, a replaced index); pruning sweeps old ones


@dataclass(frozen=True)
class Removal:
    entries: int
    num_bytes: int
    bytes_left: int


def _fingerprint_fields(fingerprint: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in fingerprint.split("|") if "=" in part)


def _entry(summary: ModelSummary) -> ModelEntry:
    fields = _fingerprint_fields(summary.fingerprint)
    block_size = fields.get("block_size", "")
    return ModelEntry(
        model_id=summary.model_id, name=summary.name,
        fingerprint_id=hashlib.blake2b(summary.fingerprint.encode(), digest_size=6).hexdigest(),
        kv_dtype=fields.get("kv_dtype", "?"), block_size=int(block_size) if block_size.isdigit() else None,
        entries=summary.entries, num_bytes=summary.num_bytes, hits=summary.hits, last_used=summary.last_used,
    )


def _explains_store_failures(operation: Callable[..., _Result]) -> Callable[..., _Result]:
    """`operation(root, ...)` with the store's own failures turned into one PagecliError each."""

    @functools.wraps(operation)
    def explained(root: Path, *args: object, **kwargs: object) -> _Result:
        try:
            with translate_errors(root / INDEX_NAME):
                return operation(root, *args, **kwargs)
        except StoreLocked as exc:
            raise PagecliError(f"The prefix store in {root} is in use by another process (a pagecli run writing "
                               "to it, say); try again when it has finished.") from exc
        except IndexCorrupt as exc:
            raise PagecliError(f"The prefix store index in {root} is damaged ({_reason(exc)}); "
                               "`pagecli cache clear` replaces it with an empty one.") from exc
        except (StoreUnavailable, OSError) as exc:
            raise PagecliError(_unusable(root, exc)) from exc

    return explained


def _unusable(root: Path, exc: BaseException) -> str:
    if not _writable(root):
        return (f"The prefix store in {root} is read-only ({_reason(exc)}); SQLite writes beside its index even "
                "to read it, so make the directory writable or point --cache-dir at another one.")
    return (f"The prefix store in {root} cannot be used ({_reason(exc)}); check that the directory and its "
            f"{INDEX_NAME} can be read and written.")


def _writable(root: Path) -> bool:
    """Whether root, or the nearest folder above it that exists, may be written (never raises)."""
    existing = next((p for p in (root, *root.parents) if os.path.exists(p)), root)
    return os.access(existing, os.W_OK)


def _reason(exc: BaseException) -> str:
    """What the innermost error said: SQLite's or the OS's own words, without our wrapping."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc)


def _open(root: Path, warnings: list[str]) -> StoreIndex | None:
    if not (root / INDEX_NAME).is_file():
        return None
    return open_index(root, warnings.append, MAINTENANCE_BUSY_TIMEOUT_S)


@_explains_store_failures
def list_models(root: Path, warnings: list[str]) -> list[ModelEntry]:
    index = _open(root, warnings)
    if index is None:
        return []
    try:
        return [_entry(s) for s in index.model_summaries()]
    finally:
        index.close()


@_explains_store_failures
def store_stats(root: Path, warnings: list[str]) -> StoreStats:
    models = list_models(root, warnings)
    index = _open(root, warnings)
    indexed: set[str] = set()
    if index is not None:
        try:
            indexed = index.indexed_paths()
        finally:
            index.close()
    files = list(iter_blob_files(root))
    disk_bytes = sum(_size(p) for p in root.glob(f"{INDEX_NAME}*")) + sum(_size(p) for p in files)
    return StoreStats(
        directory=str(root), exists=root.is_dir(), models=sum(1 for m in models if m.entries),
        entries=sum(m.entries for m in models), num_bytes=sum(m.num_bytes for m in models), disk_bytes=disk_bytes,
        hits=sum(m.hits for m in models),
        unindexed_files=sum(1 for p in files if p.relative_to(root).as_posix() not in indexed),
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@_explains_store_failures
def clear(root: Path, model: str | None, warnings: list[str]) -> Removal:
    """Delete every entry, or those of the models whose name, id or fingerprint id is `model`."""
    index = _open(root, warnings)
    if index is None:
        if model is not None:
            raise PagecliError(f"The prefix store in {root} is empty; there is nothing cached for '{model}'.")
        return Removal(0, 0, 0)
    try:
        entries = [_entry(s) for s in index.model_summaries()]
        chosen = [e for e in entries if model is None or model in (e.name, str(e.model_id), e.fingerprint_id)]
        if model is not None and not chosen:
            names = ", ".join(sorted({e.name for e in entries})) or "none"
            raise PagecliError(f"No cached prefixes for model '{model}' (cached models: {names}); "
                               "`pagecli cache ls` lists names and ids.")
        deleted = index.delete_models([e.model_id for e in chosen])
        if model is None:
            sweep_orphans(root, index.indexed_paths(), min_age_s=0.0)
        return Removal(deleted, sum(e.num_bytes for e in chosen), index.total_bytes())
    finally:
        index.close()


@_explains_store_failures
def prune(root: Path, max_bytes: int, warnings: list[str]) -> Removal:
    """Delete least recently used chain tails until the store holds at most max_bytes; sweep old leftovers."""
    index = _open(root, warnings)
    if index is None:
        return Removal(0, 0, 0)
    try:
        before = index.total_bytes()
        deleted = index.prune(max_bytes)
        sweep_orphans(root, index.indexed_paths())
        after = index.total_bytes()
        return Removal(deleted, before - after, after)
    finally:
        index.close()


@_explains_store_failures
def check(root: Path) -> list[str]:
    """Problems that would make the store inconsistent: each row's blob exists and matches its
    checksum, each blob file is indexed, and SQLite's own integrity check passes."""
    index = StoreIndex.open(root, MAINTENANCE_BUSY_TIMEOUT_S)
    try:
        problems = [] if index.integrity_ok() else ["SQLite integrity_check failed"]
        rows = index.all_blocks()
    finally:
        index.close()
    named = set()
    for row in rows:
        named.add(row.blob_path)
        path = blob_file(root, row.blob_path)
        if path is None:
            problems.append(f"a row names a path outside the store: {row.blob_path}")
        elif not path.is_file():
            problems.append(f"missing blob {row.blob_path}")
        elif checksum_file(path) != row.checksum:
            problems.append(f"checksum mismatch {row.blob_path}")
    for path in iter_blob_files(root):
        if path.relative_to(root).as_posix() not in named:
            problems.append(f"unindexed file {path.relative_to(root).as_posix()}")
    return problems
