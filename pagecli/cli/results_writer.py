"""Writing `pagecli generate` results so that a kill loses at most the requests in flight.

Invariants, for an output that is a regular file:
- One run at a time: an exclusive flock on OUTPUT.lock, held for the run; the kernel drops it when the
  process dies, so a killed run never blocks the next one. The holder's pid is written into it.
- Every finished record is, before `save` returns, fsynced in the output or in the journal
  (OUTPUT.partial). The output only ever grows by the next record in input order, so it always is
  whole lines in input order; records that finish ahead of their turn wait in the journal.
- Each line is one os.write of the whole line; a failed write is cut back to the last whole line.
- The journal is removed only once the output holds, in input order, everything it held; when
  records cannot be appended in order (--retry-errors, an output out of order), the output is
  rewritten at the end: a temp file in the same folder, then os.replace.
stdout, /dev/null or a pipe get the records in input order and are not resumed from.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from pagecli.cli.results_file import OutputScan, ResumePlan, encode_record, journal_path, plan_resume, scan_output
from pagecli.errors import PagecliError


class OutputLock:
    """This run's exclusive hold on one output; acquiring fails at once when another process has it."""

    def __init__(self, output: Path, name: str) -> None:
        self.path = output.with_name(output.name + ".lock")
        self.name = name
        self._lock = FileLock(str(self.path), timeout=0)

    def __enter__(self) -> OutputLock:
        holder = self._holder()  # read first: older filelock versions truncate the file when a contender opens it
        try:
            self._lock.acquire()
        except Timeout:
            raise PagecliError(f"Another pagecli run is writing '{self.name}' ({holder}); wait for it to finish, "
                               "or choose another -o.") from None
        except OSError as exc:
            raise PagecliError(f"Cannot create the lock file '{self.path}' beside the output: "
                               f"{exc.strerror or exc}; choose an -o in a folder you can write to.") from None
        with suppress(OSError):  # the pid only makes a clash's message more useful
            fd = os.open(self.path, os.O_WRONLY)
            try:
                pid = f"{os.getpid()}\n".encode()
                os.pwrite(fd, pid, 0)
                os.ftruncate(fd, len(pid))
            finally:
                os.close(fd)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()  # the lock file stays, as filelock advises: unlinking it races with a contender

    def _holder(self) -> str:
        try:
            return f"process {int(self.path.read_text(encoding='ascii').strip())}"
        except (OSError, ValueError):
            return "its process id is unknown"


def append_line(fd: int, data: bytes, name: str, regular: bool) -> None:
    """`data` (one whole line) at the end of the file, synced; on any failure the file is cut back to its
    last whole line and the error is one sentence."""
    start = os.lseek(fd, 0, os.SEEK_END) if regular else 0
    try:
        written = os.write(fd, data)
        while written < len(data):  # a pipe or a signal may take part of it
            written += os.write(fd, data[written:])
        if regular:
            os.fsync(fd)  # /dev/null and pipes refuse fsync (EINVAL)
    except BaseException as exc:
        if regular:
            with suppress(OSError):
                os.ftruncate(fd, start)
        if isinstance(exc, OSError):
            raise write_failed(name, exc, resumable=regular) from None
        raise


def write_failed(name: str, exc: OSError, resumable: bool = True) -> PagecliError:
    """One sentence for an output that cannot be written: a full disk, a read-only or vanished folder."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT) and resumable:
        reason = "the disk is full"
    if not resumable:
        return PagecliError(f"Cannot write results to '{name}': {reason}.")
    return PagecliError(f"Cannot write results to '{name}': {reason}. The results written so far are kept; fix "
                        "that and run the same command again to resume.")


def write_stdout(data: bytes) -> None:
    try:
        sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
    except OSError as exc:
        raise write_failed("stdout", exc, resumable=False) from None


class ResultWriter:
    """Saves each finished record (see the module's invariants) and makes the output final at the end."""

    def __init__(self, scan: OutputScan, plan: ResumePlan) -> None:
        self.name = scan.name
        self.path = scan.path
        self.resumable = scan.resumable
        self.plan = plan
        self.saved = 0  # records saved by this run
        self._records = dict(plan.records)
        self._pending = sorted((self._records.keys() - scan.output.by_line.keys()) | plan.todo)
        self._next = 0  # index into _pending of the next line the output needs
        self._output_fd: int | None = None
        self._journal_fd: int | None = None
        self._journal_complete_bytes = scan.journal.complete_bytes
        if self.resumable and plan.in_place:
            if self.path.exists():  # type: ignore[union-attr]
                self._output()  # a file we may not write fails now, not after the model has loaded
            self._cut_to(self.path, scan.output.complete_bytes, scan.output.size_bytes)  # type: ignore[arg-type]
            self._advance()

    def save(self, record: dict[str, Any]) -> None:
        data = encode_record(record)
        line = record["line"]
        self._records[line] = data
        self.saved += 1
        next_in_order = self._next < len(self._pending) and self._pending[self._next] == line
        if self.resumable and not (self.plan.in_place and next_in_order):
            append_line(self._journal(), data, self.name, regular=True)
        if self.plan.in_place:
            self._advance()

    def finish(self) -> None:
        """Every todo line is saved: make the output the final file and drop the journal."""
        if not self.plan.in_place:
            self._rewrite()
        elif self._next < len(self._pending):
            return  # not all saved: the journal keeps the rest for the next run
        if self.resumable:
            self.close()
            with suppress(FileNotFoundError):
                journal_path(self.path).unlink()  # type: ignore[arg-type]

    def close(self) -> None:
        for fd in (self._output_fd, self._journal_fd):
            if fd is not None:
                os.close(fd)
        self._output_fd = self._journal_fd = None

    def _advance(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] in self._records:
            data = self._records[self._pending[self._next]]
            if self.path is None:
                write_stdout(data)
            else:
                append_line(self._output(), data, self.name, self.resumable)
            self._next += 1

    def _output(self) -> int:
        if self._output_fd is None:
            self._output_fd = self._open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # type: ignore[arg-type]
        return self._output_fd

    def _journal(self) -> int:
        if self._journal_fd is None:
            journal = journal_path(self.path)  # type: ignore[arg-type]
            self._journal_fd = self._open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.ftruncate(self._journal_fd, self._journal_complete_bytes)  # a record cut off by a kill
            except OSError as exc:
                raise write_failed(self.name, exc) from None
        return self._journal_fd

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags, 0o666)
        except OSError as exc:
            raise PagecliError(f"Cannot write output '{self.name}' ('{path}'): {exc.strerror or exc}.") from None

    def _cut_to(self, path: Path, complete_bytes: int, size_bytes: int) -> None:
        if size_bytes > complete_bytes:  # the record a killed run was writing; the journal or a rerun has it
            try:
                os.truncate(path, complete_bytes)
            except OSError as exc:
                raise write_failed(self.name, exc) from None

    def _rewrite(self) -> None:
        """The output as every record in line order, atomically: a temp file beside it, then os.replace."""
        path: Path = self.path  # type: ignore[assignment]
        try:
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise write_failed(self.name, exc) from None
        try:
            with suppress(OSError):
                os.fchmod(fd, path.stat().st_mode & 0o7777)
            for line in sorted(self._records):
                append_line(fd, self._records[line], self.name, regular=False)
            os.fsync(fd)
            os.replace(temp, path)
            _sync_folder(path.parent)
        except BaseException as exc:
            with suppress(OSError):
                os.unlink(temp)
            if isinstance(exc, OSError):
                raise write_failed(self.name, exc) from None
            raise
        finally:
            os.close(fd)


def _sync_folder(folder: Path) -> None:
    """Makes a rename in `folder` survive a power cut (best effort: some file systems refuse)."""
    with suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def open_results(output: str, input_path: str, input_lines: list[int], retry_errors: bool) -> Iterator[ResultWriter]:
    """The run's writer for `output`: a regular file is locked for the run and checked again under the lock."""
    scan = scan_output(output, input_path)
    with OutputLock(scan.path, output) if scan.resumable else nullcontext():  # type: ignore[arg-type]
        if scan.resumable:
            scan = scan_output(output, input_path)  # it may have changed before the lock was ours
        writer = ResultWriter(scan, plan_resume(scan, input_lines, retry_errors))
        try:
            yield writer
        finally:
            writer.close()
