"""The store's directory: where the index and blobs live, private creation, atomic blob writes.

Layout under the store directory (mode 0700):
    index.sqlite                                   the SQLite index (WAL mode)
    blobs/<model_id>/<hh>/<block hash>-<checksum>.safetensors   one full KV block each

A blob's name carries its checksum, so two processes that write the same block with
different bytes never overwrite each other's file; the index row names the one that counts.
"""

from __future__ import annotations

import hashlib
import os
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


def remove_blob(root: Path, rel_path: str) -> None:
    (root / rel_path).unlink(missing_ok=True)


def iter_blob_files(root: Path) -> Iterator[Path]:
    """Every blob and temp file under the store's blobs directory."""
    blobs = root / BLOBS_DIR
    if blobs.is_dir():
        for path in blobs.rglob("*"):
            if path.is_file():
                yield path


def sweep_orphans(root: Path, indexed: set[str], min_age_s: float = ORPHAN_MIN_AGE_S) -> tuple[int, int]:
    """Delete blob files no index row names (left by a crash); returns (files, bytes) removed."""
    now = time.time()
    files = num_bytes = 0
    for path in list(iter_blob_files(root)):
        rel = path.relative_to(root).as_posix()
        if rel in indexed:
            continue
        try:
            stat = path.stat()
            if now - stat.st_mtime < min_age_s:
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        files += 1
        num_bytes += stat.st_size
    return files, num_bytes
