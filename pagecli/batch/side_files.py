"""The two files `generate` keeps beside a regular output while it runs: its lock (one run per output) and
its journal (results finished ahead of their turn), and the rule that makes them pagecli's own.

Invariants:
- Their names are OUTPUT.pagecli-lock and OUTPUT.pagecli-journal: names no user file carries by accident.
- Each is created exclusively (O_CREAT | O_EXCL, never through a symlink) and begins with pagecli's own
  first line (an empty lock file is also pagecli's: a run starting, or one killed as it started). A file of
  that name that is not a regular file starting so is not pagecli's: it is refused, naming it, and left as
  it is (never adopted, written, cut or removed).
- A run that ends, cleanly or with an error, removes its lock; the journal is removed once the output holds
  everything it held. Only a killed run leaves them, and the next run on the output adopts them.
- The input is never a side file of its output (nor the output itself: results_file.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from pagecli.errors import PagecliError

LOCK_SUFFIX = ".pagecli-lock"
JOURNAL_SUFFIX = ".pagecli-journal"
LOCK_HEADER = b"pagecli generate lock\n"  # then the holder's process id
JOURNAL_HEADER = b'{"pagecli": "generate journal"}\n'  # then result records, one a line
_READ_LIMIT_BYTES = 1 << 30  # a journal holds results, not models: past this it is not one of ours


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + LOCK_SUFFIX)


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + JOURNAL_SUFFIX)


def side_file_of(path: Path, output: Path) -> bool:
    """Whether `path` names one of `output`'s side files (as a path; the caller compares files too)."""
    return path in (lock_path(output), journal_path(output))


def not_ours(path: Path, what: str) -> PagecliError:
    return PagecliError(f"'{path}' lies where pagecli keeps this output's {what}, but it is not pagecli's; "
                        "pagecli has left it as it was: move it away, or choose another -o.")


def open_existing(path: Path, flags: int, header: bytes, what: str) -> int | None:
    """An fd on `path` if it exists and is pagecli's (a regular file, not a symlink, starting with `header`);
    None when there is no such file; a PagecliError naming it when it is not pagecli's."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink: never followed
            raise not_ours(path, what) from None
        raise PagecliError(f"Cannot open '{path}' beside the output: {exc.strerror or exc}; choose an -o in a "
                           "folder you can write to.") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.pread(fd, len(header), 0) != header:
            raise not_ours(path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(path: Path, header: bytes, what: str) -> int:
    """A new file at `path` holding `header`, made by this call (O_EXCL): never one that was there."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise not_ours(path, what) from None  # it appeared after we looked: someone else's
    except OSError as exc:
        raise PagecliError(f"Cannot create '{path}' beside the output: {exc.strerror or exc}; choose an -o in a "
                           "folder you can write to.") from None
    try:
        if header:
            os.write(fd, header)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise PagecliError(f"Cannot write '{path}' beside the output: {exc.strerror or exc}.") from None
    return fd


def read_journal(output: Path) -> bytes | None:
    """The journal's records (its header left out) when the output has a journal; None when it has none."""
    path = journal_path(output)
    fd = open_existing(path, os.O_RDONLY, JOURNAL_HEADER, "journal")
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > _READ_LIMIT_BYTES:
            raise not_ours(path, "journal")
        return os.pread(fd, size, 0)[len(JOURNAL_HEADER):]
    except OSError as exc:
        raise PagecliError(f"Cannot read '{path}' to resume from it: {exc.strerror or exc}.") from None
    finally:
        os.close(fd)


def remove_if_same(path: Path, fd: int) -> None:
    """Unlinks `path` only while it still names the file open as `fd` (ours); anything else is left."""
    try:
        if _same_file(os.stat(path, follow_symlinks=False), os.fstat(fd)):
            os.unlink(path)
    except OSError:
        pass  # gone already, or a folder we may no longer write: nothing of ours to remove


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class OutputLock:
    """This run's exclusive hold on one output: an flock on OUTPUT.pagecli-lock, which the kernel drops when
    the process dies (so a killed run never blocks the next). Acquiring fails at once when another process
    holds it; leaving removes the file (a contender that opened it before finds it unlinked and tries again)."""

    def __init__(self, output: Path, name: str) -> None:
        self.path = lock_path(output)
        self.name = name
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        for _ in range(100):  # each retry means a holder removed the file between our open and our flock
            fd = self._open()
            if self._locked(fd):
                self._fd = fd
                self._write_pid(fd)
                return self
        raise PagecliError(f"Cannot lock '{self.path}': other runs keep replacing it; try again.")

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            remove_if_same(self.path, self._fd)  # removed while still locked, then the lock dies with the fd
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        fd = open_existing(self.path, os.O_RDWR, b"", "lock file")  # the header is checked once it is locked
        # Made empty: the header and pid are written once the lock is ours, so a contender that opens it
        # first finds it empty (a run starting, or one killed as it started) and may take it.
        return fd if fd is not None else create_exclusive(self.path, b"", "lock file")

    def _locked(self, fd: int) -> bool:
        """True once `fd` holds the lock on the file the path still names; False to try again."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise PagecliError(f"Another pagecli run is writing '{self.name}' ({holder}); wait for it to "
                               "finish, or choose another -o.") from None
        try:
            still_there = _same_file(os.stat(self.path, follow_symlinks=False), os.fstat(fd))
        except FileNotFoundError:
            still_there = False
        if not still_there:
            os.close(fd)
            return False
        if os.pread(fd, len(LOCK_HEADER), 0) not in (LOCK_HEADER, b""):
            os.close(fd)
            raise not_ours(self.path, "lock file")
        return True

    def _write_pid(self, fd: int) -> None:
        data = LOCK_HEADER + f"{os.getpid()}\n".encode()
        try:  # the pid only makes a clash's message more useful
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except OSError:
            pass

    def _holder(self, fd: int) -> str:
        try:
            data = os.pread(fd, 64, 0)
            if data.startswith(LOCK_HEADER):
                return f"process {int(data[len(LOCK_HEADER):].strip())}"
        except (OSError, ValueError):
            pass
        return "its process id is unknown"
