"""What a `pagecli generate` output holds, whether pagecli may write to it, and what is left to run.

pagecli owns an output only if it is absent, empty, or a pagecli results file: every complete line a
result record (an int `line`, a string `id`, and `text` with `finish_reason`, `choices` of those, or
`error`), and a last line without its newline, if there is one, the start of a record (what a killed
run was writing).
The output is never the input. This module only reads: nothing is written, cut or appended before
`scan_output` has accepted the file. Besides the output lies its journal, OUTPUT.partial: records a
run finished before the ones ahead of them in input order (results_writer.py writes both).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagecli.errors import PagecliError

RECORD_START = b'{"id": '  # every record pagecli writes begins so; a cut-off last line that does not is not ours


def is_result_record(obj: Any) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return False
    line = obj.get("line")
    if not isinstance(line, int) or isinstance(line, bool) or line < 1:
        return False
    if isinstance(obj.get("choices"), list):  # a line with n > 1: written whole, once every candidate finished
        return all(isinstance(c, dict) and isinstance(c.get("text"), str) and "finish_reason" in c
                   for c in obj["choices"])
    return (isinstance(obj.get("text"), str) and "finish_reason" in obj) or isinstance(obj.get("error"), str)


def encode_record(record: dict[str, Any]) -> bytes:
    """One record as one UTF-8 line. Text UTF-8 cannot hold (a lone surrogate, from a JSON escape in an
    input line's id) is written as JSON escapes instead."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


@dataclass(frozen=True)
class SavedRecords:
    """The result records of one file, by input line (a later record for a line replaces an earlier one)."""

    by_line: dict[int, bytes] = field(default_factory=dict)  # input line -> its whole record line, as written
    order: tuple[int, ...] = ()  # input lines in file order
    error_lines: frozenset[int] = frozenset()  # lines whose record is an error
    complete_bytes: int = 0  # bytes of whole lines; what lies beyond is a cut-off record
    size_bytes: int = 0


@dataclass(frozen=True)
class OutputScan:
    name: str  # the output as the user wrote it, for messages
    path: Path | None  # the file written (symlinks resolved); None for stdout
    resumable: bool  # a regular file (or one to create): locked, journaled, resumed; else written once, in order
    output: SavedRecords = SavedRecords()
    journal: SavedRecords = SavedRecords()
    journal_found: bool = False


def scan_output(output: str, input_path: str) -> OutputScan:
    """The output's records and its journal's, once pagecli may write it; otherwise a PagecliError and the
    file as it was."""
    if output == "-":
        return OutputScan(output, None, resumable=False)
    path = Path(os.path.realpath(output))
    info = _stat(path, output)
    if info is None and not path.parent.is_dir():
        raise PagecliError(f"Cannot write output '{output}': the folder '{path.parent}' does not exist.")
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise PagecliError(f"Output '{output}' is a directory; pass a file path.")
    if info is not None and not stat.S_ISREG(info.st_mode):
        return OutputScan(output, path, resumable=False)  # /dev/null, a pipe: nothing to resume from
    records = SavedRecords()
    if info is not None:
        _refuse_the_input(info, input_path, output)
        records = parse_records(_read(path, output), output, strict=True)
    journal = journal_path(path)  # a run killed before its first record in order leaves only the journal
    found = journal.is_file()
    saved = parse_records(_read(journal, str(journal)), str(journal), strict=False) if found else SavedRecords()
    return OutputScan(output, path, True, records, saved, found)


def parse_records(data: bytes, name: str, strict: bool) -> SavedRecords:
    """The records of a results file. `strict` (the output): any line that is not one refuses the file,
    naming it. Not strict (the journal, pagecli's own): such lines are skipped."""
    complete = data[: data.rfind(b"\n") + 1]
    cut_off = data[len(complete):]
    if strict and cut_off and not _is_cut_off_record(cut_off):
        raise _not_ours(name, complete.count(b"\n") + 1, "is not a result record")
    by_line: dict[int, bytes] = {}
    order: list[int] = []
    errors: set[int] = set()
    for number, raw in enumerate(complete.split(b"\n")[:-1], start=1):
        record, problem = _read_record(raw)
        if record is None:
            if strict:
                raise _not_ours(name, number, problem)
            continue
        line = record["line"]
        by_line[line] = raw + b"\n"
        order.append(line)
        (errors.add if "error" in record else errors.discard)(line)
    return SavedRecords(by_line, tuple(order), frozenset(errors), len(complete), len(data))


def _read_record(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    if not raw.strip():
        return None, "is blank"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None, "is not JSON"
    return (obj, "") if is_result_record(obj) else (None, "is not a result record")


def _is_cut_off_record(tail: bytes) -> bool:
    """A last line without its newline that a killed pagecli run may have left: it starts as a record does,
    and it is not a whole JSON value of something else."""
    if not tail.startswith(RECORD_START):
        return False
    try:
        return is_result_record(json.loads(tail))
    except (ValueError, RecursionError):
        return True  # cut off mid-record


def _not_ours(name: str, line: int, problem: str) -> PagecliError:
    return PagecliError(
        f"'{name}' is not a pagecli results file: its line {line} {problem}. pagecli writes only to a new or empty "
        "file or to its own results, and has left this one as it was; choose another -o."
    )


def _refuse_the_input(output_info: os.stat_result, input_path: str, output: str) -> None:
    try:
        input_info = os.fstat(sys.stdin.fileno()) if input_path == "-" else os.stat(input_path)
    except (OSError, ValueError, AttributeError):
        return  # stdin without a file behind it (a test's, a closed one) cannot be the output
    if (input_info.st_dev, input_info.st_ino) == (output_info.st_dev, output_info.st_ino):
        raise PagecliError(f"The output '{output}' is the input file; results would overwrite the requests. "
                           "Choose another -o.")


def _stat(path: Path, name: str) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PagecliError(f"Cannot read output '{name}': {exc.strerror or exc}.") from None


def _read(path: Path, name: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PagecliError(f"Cannot read output '{name}' to resume from it: {exc.strerror or exc}.") from None


@dataclass(frozen=True)
class ResumePlan:
    """What a run on this output has to do: which input lines to run, and how results reach the file."""

    todo: frozenset[int]  # input lines to run
    kept: int  # input lines whose result is kept
    records: dict[int, bytes]  # results so far: the output's, then the journal's (newer) on top
    in_place: bool  # new records are appended to the output in input order; else it is rewritten at the end
    settled: bool  # the output is already the final file: nothing to run, merge, cut or reorder


def plan_resume(scan: OutputScan, input_lines: list[int], retry_errors: bool) -> ResumePlan:
    output, journal = scan.output, scan.journal
    records = {**output.by_line, **journal.by_line}
    errors = (output.error_lines - journal.by_line.keys()) | journal.error_lines
    redo = errors if retry_errors else frozenset()
    todo = frozenset(line for line in input_lines if line not in records or line in redo)
    to_append = (records.keys() - output.by_line.keys()) | todo
    replaced = any(output.by_line.get(line, raw) != raw for line, raw in journal.by_line.items())
    ascending = all(a < b for a, b in zip(output.order, output.order[1:]))
    in_order = ascending and not replaced and (not output.order or not to_append or output.order[-1] < min(to_append))
    settled = in_order and not to_append and not scan.journal_found and output.complete_bytes == output.size_bytes
    kept = sum(1 for line in input_lines if line in records and line not in todo)
    return ResumePlan(todo, kept, records, in_order, settled)
