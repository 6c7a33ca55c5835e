"""One process at a time per session: a lock file per session in `.locks/` beside the sessions, and
the holder's pid beside the lock.

`.locks/NAME.json.lock` is locked with flock (filelock), which the kernel drops when the process dies,
so a chat that was killed never blocks the next one. The lock cannot carry its holder's pid (older
filelock versions truncate the file when a contender opens it), so the holder writes it to
`.locks/NAME.json.pid`; that file is read only while the lock is held, and then names the live holder.
Within one process the lock is re-entrant: a save during a chat that holds its session just writes.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock, Timeout

from pagecli.errors import PagecliError

LOCKS_FOLDER = ".locks"
# One FileLock per lock file in this process, re-entrant: two opens of one file conflict under flock
# even within a process, so a save during a chat that holds its session must reuse the chat's lock.
_process_locks: dict[Path, FileLock] = {}


class SessionBusy(PagecliError):
    """Another live process holds the session."""


class SessionLock:
    """This process's claim on one session file; `acquire` fails at once (no waiting) when another has it."""

    def __init__(self, name: str, session_file: Path) -> None:
        self.name = name
        self.lock_path = session_file.parent / LOCKS_FOLDER / f"{session_file.name}.lock"
        self.pid_path = self.lock_path.with_suffix(".pid")
        self._lock = _process_lock(self.lock_path)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> SessionLock:
        newly = not self._lock.is_locked
        try:
            self._lock.acquire()
        except Timeout:
            raise SessionBusy(
                f"Session '{self.name}' is open in another pagecli chat ({self._holder()}); leave that chat first, "
                "or use another session name."
            ) from None
        except OSError as exc:
            raise PagecliError(f"Cannot lock session '{self.name}' ('{self.lock_path}'): {exc.strerror or exc}.") \
                from exc
        if newly:
            self._write_pid()
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> SessionLock:
        """`with lock_session(name):` - the lock is already held; leaving the block releases it."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _write_pid(self) -> None:
        try:
            fd = os.open(self.pid_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(f"{os.getpid()}\n")
        except OSError:
            pass  # the pid only makes the message of a clash more useful

    def _holder(self) -> str:
        try:
            pid = int(self.pid_path.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            return "its process id is unknown"
        return f"process {pid}"


def _process_lock(lock_path: Path) -> FileLock:
    lock = _process_locks.get(lock_path)
    if lock is None:
        lock = _process_locks[lock_path] = FileLock(str(lock_path), timeout=0, mode=0o600)
    return lock
