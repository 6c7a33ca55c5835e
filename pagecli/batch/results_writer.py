"""Writing `pagecli generate` results so that a kill loses at most the requests in flight.

Invariants, for an output that is a regular file:
- One run at a time: an exclusive flock on OUTPUT.pagecli-lock, held for the run (side_files.py); the kernel
  drops it when the process dies, so a killed run never blocks the next one.
- Every finished record is stamped with what it answers (results_file.RunIdentity) and, before `save`
  returns, fsynced in the output or in the journal (OUTPUT.pagecli-journal). The output only ever grows by
  the next record in input order, so it always is whole lines in input order; records that finish ahead of
  their turn wait in the journal.
- Each line is one os.write of the whole line; a failed write is cut back to the last whole line.
- The journal is removed only once the output holds, in input order, everything it held, and the lock
  when the run ends; neither is ever a file pagecli did not make (side_files.py). When
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

from pagecli.batch.results_file import (OutputScan, ResumePlan, RunIdentity, encode_record, plan_resume,
                                      scan_output)
from pagecli.batch.side_files import (JOURNAL_HEADER, OutputLock, create_exclusive, journal_path, open_existing,
                                    remove_if_same)
from pagecli.errors import PagecliError


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

    def __init__(self, scan: OutputScan, plan: ResumePlan, identity: RunIdentity) -> None:
        self.name = scan.name
        self.identity = identity
        self.path = scan.path
        self.resumable = scan.resumable
        self.plan = plan
        self.saved = 0  # records saved by this run
        self._records = dict(plan.records)
        self._pending = sorted((self._records.keys() - scan.output.by_line.keys()) | plan.todo)
        self._next = 0  # index into _pending of the next line the output needs
        self._output_fd: int | None = None
        self._journal_fd: int | None = None
        self._journal_found = scan.journal_found
        self._journal_complete_bytes = len(JOURNAL_HEADER) + scan.journal.complete_bytes
        if self.resumable and plan.in_place:
            if self.path.exists():  # type: ignore[union-attr]
                self._output()  # a file we may not write fails now, not after the model has loaded
            self._cut_to(self.path, scan.output.complete_bytes, scan.output.size_bytes)  # type: ignore[arg-type]
            self._advance()

    def save(self, record: dict[str, Any]) -> None:
        data = encode_record(self.identity.stamp(record))
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
            self._drop_journal()
            self.close()

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

    def _drop_journal(self) -> None:
        """Removes the journal, ours (the one this run made or adopted), now that the output holds it all."""
        journal = journal_path(self.path)  # type: ignore[arg-type]
        if self._journal_fd is None and self._journal_found:
            self._journal_fd = open_existing(journal, os.O_RDONLY, JOURNAL_HEADER, "journal")
        if self._journal_fd is not None:
            remove_if_same(journal, self._journal_fd)

    def _journal(self) -> int:
        if self._journal_fd is None:
            journal = journal_path(self.path)  # type: ignore[arg-type]
            found = open_existing(journal, os.O_RDWR | os.O_APPEND, JOURNAL_HEADER, "journal") \
                if self._journal_found else None
            self._journal_fd = found if found is not None else create_exclusive(journal, JOURNAL_HEADER, "journal")
            self._journal_found = True
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


def _start_over(scan: OutputScan) -> None:
    """Empties the output (a pagecli results file: scan_output said so) and removes its journal."""
    path: Path = scan.path  # type: ignore[assignment]
    try:
        if scan.output.size_bytes:
            os.truncate(path, 0)
    except OSError as exc:
        raise write_failed(scan.name, exc) from None
    if scan.journal_found:
        fd = open_existing(journal_path(path), os.O_RDONLY, JOURNAL_HEADER, "journal")
        if fd is not None:
            remove_if_same(journal_path(path), fd)
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
def open_results(output: str, input_path: str, identity: RunIdentity, retry_errors: bool,
                 force_restart: bool = False) -> Iterator[ResultWriter]:
    """The run's writer for `output`: a regular file is locked for the run and checked again under the lock.
    `force_restart` empties a pagecli results file (and drops its journal) before running every line."""
    scan = scan_output(output, input_path)
    with OutputLock(scan.path, output) if scan.resumable else nullcontext():  # type: ignore[arg-type]
        if scan.resumable:
            scan = scan_output(output, input_path)  # it may have changed before the lock was ours
            if force_restart:
                _start_over(scan)
                scan = scan_output(output, input_path)
        writer = ResultWriter(scan, plan_resume(scan, identity, retry_errors), identity)
        try:
            yield writer
        finally:
            writer.close()
