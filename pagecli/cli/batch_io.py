"""Batch files for `pagecli generate`: reading requests, and writing results that survive a kill.

Input: JSONL (`prompt` or `messages`, optional `id` and sampling fields), OpenAI batch-request
lines (`custom_id`, `body.messages`, `body.max_tokens`, ...), or plain text with one prompt per
line. Blank lines are skipped. A bad line becomes an error record that names its line number.

Output: one JSONL record per input line, in input order, each written whole with one append
and flushed. Re-running with the same output file skips lines already done and drops a
half-written last line left by a killed run.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pagecli.errors import PagecliError

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop")
_OPENAI_KEY_ALIASES = {"max_completion_tokens": "max_tokens"}


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line number in the input
    request_id: str
    prompt: str | list[dict[str, Any]]
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadLine:
    line: int
    request_id: str
    error: str


def read_input(path: str) -> list[str]:
    """The input's lines; '-' reads stdin. Undecodable bytes are kept visible, not fatal."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            data = Path(path).read_bytes()
    except FileNotFoundError:
        raise PagecliError(f"Input file '{path}' does not exist.") from None
    except IsADirectoryError:
        raise PagecliError(f"Input '{path}' is a directory; pass a .jsonl or .txt file.") from None
    except OSError as exc:
        raise PagecliError(f"Cannot read input '{path}': {exc.strerror or exc}.") from None
    return data.decode("utf-8", errors="replace").splitlines()


def detect_format(path: str, lines: list[str], requested: str) -> str:
    if requested != "auto":
        return requested
    if path.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    return "jsonl" if first.startswith("{") else "text"


def parse_requests(lines: list[str], fmt: str) -> Iterator[BatchRequest | BadLine]:
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if fmt == "text":
            yield BatchRequest(number, f"line-{number}", raw)
        else:
            yield parse_json_line(raw, number)


def parse_json_line(raw: str, number: int) -> BatchRequest | BadLine:
    default_id = f"line-{number}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return BadLine(number, default_id, f"line {number}: invalid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return BadLine(number, default_id, f"line {number}: expected a JSON object, got {type(obj).__name__}")
    body = obj.get("body") if isinstance(obj.get("body"), dict) else obj
    request_id = obj.get("custom_id", obj.get("id", default_id))
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        return BadLine(number, default_id, f"line {number}: 'id' must be a string or an integer")
    request_id = str(request_id)
    prompt, problem = _prompt_of(body)
    if problem:
        return BadLine(number, request_id, f"line {number}: {problem}")
    sampling = {_OPENAI_KEY_ALIASES.get(k, k): v for k, v in body.items()
                if _OPENAI_KEY_ALIASES.get(k, k) in SAMPLING_KEYS and v is not None}
    return BatchRequest(number, request_id, prompt, sampling)  # type: ignore[arg-type]


def _prompt_of(body: dict[str, Any]) -> tuple[str | list[dict[str, Any]] | None, str | None]:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            return None, "'messages' must be a non-empty list"
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                return None, "each message needs a string 'role' and a string 'content'"
        return messages, None
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            return None, "'prompt' must be a string"
        if not prompt.strip():
            return None, "'prompt' is empty"
        return prompt, None
    return None, "needs a 'prompt' string or a 'messages' list"


class ResultWriter:
    """Appends result records in input order; each record is one write of one complete line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.done_lines: set[int] = set()
        self._stream: IO[str]
        self._regular_file = False  # only a regular file is resumed from and synced to disk
        if path == "-":
            self._stream = sys.stdout
        else:
            self.done_lines = _recover(Path(path))
            try:
                self._stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                raise PagecliError(f"Cannot write output '{path}': {exc.strerror or exc}.") from None
            self._regular_file = stat.S_ISREG(os.fstat(self._stream.fileno()).st_mode)

    def write(self, record: dict[str, Any]) -> None:
        self._stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._stream.flush()
        if self._regular_file:
            os.fsync(self._stream.fileno())  # /dev/null or a pipe refuses fsync (EINVAL)

    def close(self) -> None:
        if self._stream is not sys.stdout:
            self._stream.close()


def _recover(path: Path) -> set[int]:
    """Line numbers already answered in an existing output file; a trailing partial line is cut off."""
    if not path.exists():
        return set()
    if path.is_dir():
        raise PagecliError(f"Output '{path}' is a directory; pass a file path.")
    if not path.is_file():
        return set()  # /dev/null, a named pipe: nothing to resume from
    data = path.read_bytes()
    complete_end = data.rfind(b"\n") + 1
    if complete_end < len(data):
        with path.open("r+b") as f:
            f.truncate(complete_end)  # the half-written line of a killed run
    done: set[int] = set()
    for raw in data[:complete_end].splitlines():
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            raise PagecliError(
                f"Output '{path}' holds a line that is not JSON; it is not a pagecli result file. Choose another -o."
            ) from None
        if isinstance(record, dict) and isinstance(record.get("line"), int):
            done.add(record["line"])
    return done
