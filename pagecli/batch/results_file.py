"""What a `pagecli generate` output holds, whether pagecli may write to it, whether it answers this run's
input and settings, and what is left to run.

pagecli owns an output only if it is absent, empty, or a pagecli results file: every complete line a
result record (an int `line`, a string `id`, and `text` with `finish_reason`, `choices` of those, or
`error`), and a last line without its newline, if there is one, the start of a record (what a killed
run was writing).
The output is never the input, and the input is never one of its side files (side_files.py). This module
only reads: nothing is written, cut or appended before `scan_output` has accepted the file. Beside the
output lies its journal, OUTPUT.pagecli-journal: records a run finished before the ones ahead of them in
input order (results_writer.py writes both).

Every record carries what it answers (`RunIdentity`): `line_sha256`, a digest of its input line (and the
input's format), and `settings_sha256`, a digest of the run's sampling settings. A resume is refused when a
record answers another line or other settings. Records written before pagecli stamped them have neither;
they are kept only when their `id` is the one the input gives their line, and the run says it could not
check more.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from typing import Any

from pagecli.batch.side_files import journal_path, lock_path, read_journal
from pagecli.config import SamplingParams
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


def settings_digest(sampling: SamplingParams) -> str:
    """A digest of the sampling settings that differ from their defaults (so a setting added later, left at
    its default, does not change it): two runs with the same digest choose tokens alike."""
    changed = {}
    for f in dataclass_fields(sampling):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        value = getattr(sampling, f.name)
        if value != default:
            changed[f.name] = value
    text = json.dumps(changed, sort_keys=True, default=repr, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


@dataclass(frozen=True)
class RunIdentity:
    """What this run answers: each input line's digest and request id, and its settings' digest."""

    input_name: str  # for messages: 'in.jsonl' or stdin
    line_sha256: dict[int, str]  # input line -> requests.line_digest of it
    request_ids: dict[int, str]  # input line -> the id its record carries
    settings_sha256: str

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with what it answers, as the last fields (a record still begins with its id)."""
        return {**record, "line_sha256": self.line_sha256[record["line"]], "settings_sha256": self.settings_sha256}


@dataclass(frozen=True)
class SavedRecords:
    """The result records of one file, by input line (a later record for a line replaces an earlier one)."""

    by_line: dict[int, bytes] = field(default_factory=dict)  # input line -> its whole record line, as written
    order: tuple[int, ...] = ()  # input lines in file order
    error_lines: frozenset[int] = frozenset()  # lines whose record is an error
    complete_bytes: int = 0  # bytes of whole lines; what lies beyond is a cut-off record
    size_bytes: int = 0
    # input line -> (its record's id, line_sha256, settings_sha256); the digests are None in an older record
    answers: dict[int, tuple[str, str | None, str | None]] = field(default_factory=dict)


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
    _refuse_the_input(path, input_path, output)
    records = SavedRecords()
    if info is not None:
        records = parse_records(_read(path, output), output, strict=True)
    journal = read_journal(path)  # a run killed before its first record in order leaves only the journal
    saved = SavedRecords() if journal is None else parse_records(journal, str(journal_path(path)), strict=False)
    return OutputScan(output, path, True, records, saved, journal is not None)


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
    answers: dict[int, tuple[str, str | None, str | None]] = {}
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
        answers[line] = (record["id"], _text_or_none(record.get("line_sha256")),
                         _text_or_none(record.get("settings_sha256")))
    return SavedRecords(by_line, tuple(order), frozenset(errors), len(complete), len(data), answers)


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


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


def _refuse_the_input(output: Path, input_path: str, name: str) -> None:
    """PagecliError when the input is the output or one of the output's side files, by any path."""
    try:
        input_info = os.fstat(sys.stdin.fileno()) if input_path == "-" else os.stat(input_path)
    except (OSError, ValueError, AttributeError):
        return  # stdin without a file behind it (a test's, a closed one) cannot be the output
    for path, what in ((output, "is the input file; results would overwrite the requests"),
                       (journal_path(output), "keeps its journal in the input file"),
                       (lock_path(output), "keeps its lock in the input file")):
        try:
            info = path.stat()
        except OSError:
            continue
        if (input_info.st_dev, input_info.st_ino) == (info.st_dev, info.st_ino):
            raise PagecliError(f"The output '{name}' {what}. Choose another -o.")


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
    unchecked: int = 0  # kept records older than line digests: their ids match, their text could not be checked


def plan_resume(scan: OutputScan, identity: RunIdentity, retry_errors: bool) -> ResumePlan:
    """The plan for this run, once every saved record answers this run's input and settings (`check_answers`)."""
    unchecked = check_answers(scan, identity)
    input_lines = list(identity.line_sha256)
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
    return ResumePlan(todo, kept, records, in_order, settled, unchecked)


def check_answers(scan: OutputScan, identity: RunIdentity) -> int:
    """A PagecliError when the output or its journal holds a result for another input line or other sampling
    settings than this run's; else the number of older records (no digests) kept because their ids match."""
    unchecked = set()
    for line, (request_id, line_sha, settings_sha) in {**scan.output.answers, **scan.journal.answers}.items():
        expected = identity.line_sha256.get(line)
        if expected is None:
            raise _answers_other(scan.name, f"it holds a result for line {line}, and {identity.input_name} has "
                                            f"no request on line {line}", "the input")
        if line_sha is None and request_id == identity.request_ids[line]:
            unchecked.add(line)
        elif line_sha != expected:
            raise _answers_other(scan.name, f"its result for line {line} answers another request than line {line} "
                                            f"of {identity.input_name}", "the input")
        elif settings_sha != identity.settings_sha256:
            raise _answers_other(scan.name, "its results were made with other sampling settings than this run's "
                                            "(temperature, seed, max_tokens, stop, ...)", "the settings")
    return len(unchecked)


def _answers_other(name: str, why: str, made_from: str) -> PagecliError:
    return PagecliError(f"'{name}' holds results of another run: {why}. Resume it only with {made_from} it was "
                        "made from; pass --force-restart to run every line again into it, or choose a new -o.")
