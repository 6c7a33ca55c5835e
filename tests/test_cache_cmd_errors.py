"""`pagecli cache` on a store it cannot use: read-only, held by another process, a path the system refuses.
Each is one sentence naming the store and what to do, never a traceback (issue 26, case 11)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pagecli.cli.cache_cmd  # noqa: F401 - registers `cache` on the app
from pagecli.cli import main
from pagecli.store.files import INDEX_NAME
from pagecli.store.index import StoreIndex

PAGECLI = Path(sys.executable).with_name("pagecli")
COMMANDS = {"ls": ["ls"], "stats": ["stats"], "stats --verify": ["stats", "--verify"], "clear": ["clear"],
            "prune": ["prune", "--max-size", "0"]}
# The store directory, bind-mounted read-only over itself in a private mount namespace: only the command
# inside sees it read-only, and nothing is left mounted when it exits (root or not: permission bits do
# not stop root, a read-only mount does).
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "store"
    index = StoreIndex.open(root)
    index.model_id("fingerprint|block_size=16|kv_dtype=float32", "tiny")
    index.close()
    return root


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Unexpected" not in lines[0] and "Traceback" not in err, err
    return lines[0]


def _private_mounts_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", READ_ONLY_MOUNT, "/tmp", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _private_mounts_work(), reason="needs unshare and user namespaces for a read-only mount")
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_store_is_one_sentence_naming_it(command, store):
    result = subprocess.run(["unshare", "-rm", "sh", "-c", READ_ONLY_MOUNT, str(store),
                             str(PAGECLI), "cache", *COMMANDS[command], "--cache-dir", str(store)],
                            capture_output=True, text=True, timeout=120)
    line = _one_error_line(result.stderr)
    assert result.returncode == 2
    assert f"The prefix store in {store} is read-only" in line and "--cache-dir" in line, line


@pytest.mark.timeout(120)  # the index waited 30 s for the lock, then raised sqlite3's OperationalError
@pytest.mark.parametrize("command", ["clear", "prune"])
def test_a_store_another_process_is_writing_is_busy_for_a_few_seconds_then_one_sentence(command, store, capsys):
    holder = sqlite3.connect(store / INDEX_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # what a pagecli run does while it writes
    try:
        started = time.monotonic()
        code = main(["cache", *COMMANDS[command], "--cache-dir", str(store)])
        waited_s = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and waited_s < 15
    assert f"The prefix store in {store} is in use by another process" in line and "try again" in line, line


def test_listing_a_store_another_process_is_writing_needs_no_wait(store, capsys):
    holder = sqlite3.connect(store / INDEX_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        code = main(["cache", "ls", "--cache-dir", str(store)])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert code == 0 and "tiny" in capsys.readouterr().out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_store_path_the_system_refuses_is_one_sentence(command, tmp_path, capsys):
    too_long = tmp_path / ("s" * 300)  # longer than a file name may be
    code = main(["cache", *COMMANDS[command], "--cache-dir", str(too_long)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "cannot be used (" in line and "File name too long" in line, line
