"""The store's directory: where the index and blobs live, private creation, atomic blob writes.

Layout under the store directory (mode 0700):
    index.sqlite                                   the SQLite index (WAL mode)
    blobs/<model_id>/<hh>/<block hash>-<checksum>.safetensors   one full KV block each

A blob's name carries its checksum, so two processes that write the same block with
different bytes never overwrite each other's file; the index row names the one that counts.

The store deletes only files it made, inside its own folder: a path from the index is used only if
it has the shape `blob_rel_path` gives (no absolute part, no `..`) and resolves under `blobs/`
(`blob_file`); a row naming anything else is a bad row, dropped, its target never opened or removed.
An unindexed file is swept only if it is a regular file named as a blob or a blob's temp file, and a
blob's first bytes say it is a pagecli KV block; anything else under `blobs/` is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pagecli.paths import make_private_dir, prefix_store_dir

INDEX_NAME = "index.sqlite"
BLOBS_DIR = "blobs"
BLOB_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
ORPHAN_MIN_AGE_S = 600.0  # a younger unindexed blob may belong to a write in flight in another process
_BLOB_NAME = r"(?P<hash>[0-9a-f]{2,128})-[0-9a-f]{16}\.safetensors"
_BLOB_REL_PATH = re.compile(rf"{BLOBS_DIR}/[0-9]{{1,19}}/(?P<dir>[0-9a-f]{{2}})/{_BLOB_NAME}")
_TEMP_NAME = re.compile(rf"\.(?P<blob>{_BLOB_NAME})\.[0-9]+\.[0-9]+\.[0-9]+{re.escape(TEMP_SUFFIX)}")
_BLOB_LABEL = b"pagecli-kv-block;"  # blobs.py's metadata label begins so


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # hardware-accelerated on most CPUs: about 1 GB/s


def checksum_file(path: Path) -> str:
    return checksum(path.read_bytes())


def resolve_store_dir(configured: str | None = None) -> Path:
    """The configured directory (profile key disk_cache_dir), else PAGECLI_CACHE_DIR, else the user cache."""
    return Path(configured).expanduser() if configured else prefix_store_dir()


def blob_rel_path(model_id: int, block_hash: bytes, checksum: str) -> str:
    name = block_hash.hex()
    return f"{BLOBS_DIR}/{model_id}/{name[:2]}/{name}-{checksum[:16]}{BLOB_SUFFIX}"


def write_atomic(root: Path, rel_path: str, data: bytes) -> None:
    """Write data to root/rel_path by temp file + rename: readers see the whole file or none."""
    path = root / rel_path
    if not path.parent.is_dir():
        make_private_dir(path.parent)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def is_blob_rel_path(rel_path: object) -> bool:
    """Whether an index row's path has the shape `blob_rel_path` gives: relative, no `..`, a blob's name."""
    if not isinstance(rel_path, str):
        return False
    match = _BLOB_REL_PATH.fullmatch(rel_path)
    return match is not None and match["hash"][:2] == match["dir"]


def blob_file(root: Path, rel_path: str) -> Path | None:
    """root/rel_path, for a path this store makes that resolves (symlinks followed) inside its blobs folder;
    None for any other path an index row may name."""
    if not is_blob_rel_path(rel_path):
        return None
    path = root / rel_path
    blobs = os.path.realpath(root / BLOBS_DIR)
    return path if os.path.realpath(path).startswith(blobs + os.sep) else None


def remove_blob(root: Path, rel_path: str) -> bool:
    """Deletes the store's own blob file at rel_path; a path outside the store, or anything but a regular
    file, is left alone. True when a file was removed."""
    path = blob_file(root, rel_path)
    if path is None:
        return False
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def iter_blob_files(root: Path) -> Iterator[Path]:
    """Every regular file under the store's blobs directory (symlinks neither followed nor listed)."""
    blobs = root / BLOBS_DIR
    for folder, _dirs, names in os.walk(blobs, followlinks=False):
        for name in names:
            path = Path(folder) / name
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    yield path
            except FileNotFoundError:
                continue


def is_own_file(root: Path, path: Path) -> bool:
    """Whether an unindexed file under blobs/ is one this store made: a blob (by its path and first bytes)
    or a blob's temp file (by its name, in a blob's folder)."""
    rel = path.relative_to(root).as_posix()
    folder, _, name = rel.rpartition("/")
    temp = _TEMP_NAME.fullmatch(name)
    if temp is not None:
        return is_blob_rel_path(f"{folder}/{temp['blob']}")
    return is_blob_rel_path(rel) and _holds_a_block(path)


def _holds_a_block(path: Path) -> bool:
    """A safetensors file whose metadata carries blobs.py's label."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len <= 1 << 20:
                return False
            metadata = json.loads(f.read(header_len)).get("__metadata__", {})
    except (OSError, ValueError, AttributeError):
        return False
    label = metadata.get("pagecli") if isinstance(metadata, dict) else None
    return isinstance(label, str) and label.encode("utf-8", "replace").startswith(_BLOB_LABEL)


def sweep_orphans(root: Path, indexed: set[str], min_age_s: float = ORPHAN_MIN_AGE_S) -> tuple[int, int]:
    """Delete the store's own files no index row names (left by a crash); files it did not make stay.
    Returns (files, bytes) removed."""
    now = time.time()
    files = num_bytes = 0
    for path in list(iter_blob_files(root)):
        rel = path.relative_to(root).as_posix()
        if rel in indexed:
            continue
        try:
            info = path.lstat()
            if now - info.st_mtime < min_age_s or not is_own_file(root, path):
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        files += 1
        num_bytes += info.st_size
    return files, num_bytes
