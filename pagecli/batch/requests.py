"""Batch input for `pagecli generate` (and `bench run FILE`): the input's lines, made into requests.

Input: JSONL (`prompt` or `messages`, optional `id`, sampling fields (`lora` and `lora_scale` among them: the LoRA
adapter a line runs) and `response_format`), OpenAI batch-request
lines (`custom_id`, `method`, `url`, `body.messages`, `body.max_completion_tokens`, ...), or plain
text with one prompt per line. Lines end at `\\n` only (a `\\r` before it is dropped), so U+2028,
U+0085 or a form feed inside a prompt never splits it; the encoding and the line-length limit are
input_lines.py's (UTF-8, or UTF-16/32 by their BOM; --max-line-bytes). Blank lines
are skipped. A line that cannot become a request is a BadLine naming its line number, whatever
raised: every per-line failure is worded by `request_failure`. Where results go is results_file.py.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from pagecli.config import SamplingParams
from pagecli.config.structured import spec_from_response_format
from pagecli.errors import PagecliError, RequestError, request_failure
from pagecli.batch.input_lines import DEFAULT_MAX_LINE_BYTES, read_lines
from pagecli.batch.line_tools import tools_of_line
from pagecli.models.messages import Conversation, read_messages
from pagecli.models.tools import ToolRequest

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "seed", "stop", "lora", "lora_scale")
_OPENAI_KEY_ALIASES = {"max_completion_tokens": "max_tokens"}
BEAM_KEYS = ("beam_width", "length_penalty", "early_stopping")  # generate only (engine/beam.py)
_NUMERIC_KEYS = {"beam_width": int, "length_penalty": float,
                 "max_tokens": int, "top_k": int, "seed": int, "temperature": float, "top_p": float, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "n": int,
                 "lora_scale": float}
# Fields pagecli does not implement, with the values that ask for nothing: any other value is the
# line's error, never silently dropped (an answer without the logprobs asked for looks like a bug).
_UNSUPPORTED_KEYS = {"logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1),
                     "echo": (None, False), "suffix": (None, ""),
                     "functions": (None, [])}  # OpenAI's old name for `tools`
OPENAI_BATCH_URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line number in the input
    request_id: str
    prompt: str | list[dict[str, Any]] | Conversation  # chat messages are already flattened by read_messages
    sampling: dict[str, Any] = field(default_factory=dict)
    tools: ToolRequest | None = None  # the line's tools and tool_choice (line_tools.py)
    line_sha256: str = ""  # line_digest of the line: what its record answers


@dataclass(frozen=True)
class BadLine:
    line: int
    request_id: str
    error: str  # starts with "line N: "
    line_sha256: str = ""


def input_name(path: str) -> str:
    return "stdin" if path == "-" else f"'{path}'"


def read_requests(path: str, fmt: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[BatchRequest | BadLine]:
    """Every non-blank line of the input as a request or a bad line; an input with none is an error."""
    lines = read_input(path, max_line_bytes)
    items = list(parse_requests(lines, detect_format(path, lines, fmt)))
    if not items:
        raise PagecliError(f"There are no requests in {input_name(path)}: every line is blank. Give one request "
                           "per line (JSONL or plain text).")
    return items


def read_input(path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[str]:
    """The input's lines (input_lines.py: the encoding by its BOM, each line at most `max_line_bytes`);
    '-' reads stdin. Undecodable bytes are kept visible, not fatal."""
    try:
        if path == "-":
            return read_lines(sys.stdin.buffer, input_name(path), max_line_bytes)
        with open(path, "rb") as stream:
            return read_lines(stream, input_name(path), max_line_bytes)
    except FileNotFoundError:
        raise PagecliError(f"Input file '{path}' does not exist.") from None
    except IsADirectoryError:
        raise PagecliError(f"Input '{path}' is a directory; pass a .jsonl or .txt file.") from None
    except OSError as exc:
        raise PagecliError(f"Cannot read input '{path}': {exc.strerror or exc}.") from None


def detect_format(path: str, lines: list[str], requested: str) -> str:
    if requested != "auto":
        return requested
    if path.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    return "jsonl" if first.startswith("{") else "text"


def line_digest(raw: str, fmt: str) -> str:
    """What one input line asks, as a short digest: its text as read, and whether it was read as JSONL or text."""
    return hashlib.sha256(f"{fmt}\n{raw}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


def parse_requests(lines: list[str], fmt: str) -> Iterator[BatchRequest | BadLine]:
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        item = BatchRequest(number, f"line-{number}", raw) if fmt == "text" else parse_json_line(raw, number)
        yield replace(item, line_sha256=line_digest(raw, fmt))


def parse_json_line(raw: str, number: int) -> BatchRequest | BadLine:
    """One JSONL line as a request, or a BadLine with the line's id where it has a usable one."""
    request_id = f"line-{number}"
    try:
        obj = _json_object(raw)
        request_id = _request_id(obj, request_id)
        body = _request_body(obj)
        refuse_unsupported_fields(body)
        prompt, tools, tool_sampling = tools_of_line(body, _prompt_of(body))
    except Exception as exc:  # noqa: BLE001 - request_failure sorts the line's fault from a bug
        message = request_failure(exc)
        if message is None:
            raise
        return BadLine(number, request_id, f"line {number}: {message}")
    sampling = {**sampling_fields(body), **tool_sampling}
    if body.get("n") is not None:
        sampling["n"] = body["n"]  # candidates: a line's record then holds `choices`
    sampling.update({key: body[key] for key in BEAM_KEYS if body.get(key) is not None})  # beams: `choices` too
    return BatchRequest(number, request_id, prompt, sampling, tools)


def refuse_unsupported_fields(body: dict[str, Any]) -> None:
    """RequestError for a field pagecli does not implement that asks for something (`logprobs`, `best_of`, ...)."""
    for key, harmless in _UNSUPPORTED_KEYS.items():
        value = body.get(key)
        if key in body and not any(value is h or (type(value) is type(h) and value == h) for h in harmless):
            raise RequestError(f"'{key}' is not supported by pagecli yet; remove it from the request "
                               f"(got {json.dumps(value)})")


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a request body under SamplingParams' names (`max_completion_tokens` is
    `max_tokens`, and wins over it); fields set to null are left out."""
    fields = {k: v for k, v in body.items() if k in SAMPLING_KEYS and v is not None}
    for alias, name in _OPENAI_KEY_ALIASES.items():
        if body.get(alias) is not None:
            fields[name] = body[alias]
    if body.get("response_format") is not None:
        fields["response_format"] = body["response_format"]  # read by sampling_with: its errors are the line's
    return fields


def sampling_with(base: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """`base` with a request's sampling fields on top, each checked for its type and range; a bad one
    raises RequestError naming the field. `generate` and the server both read sampling fields here."""
    values = {f.name: getattr(base, f.name) for f in dataclass_fields(base)}  # shallow: structured stays a spec
    for key, value in overrides.items():
        if key == "response_format":  # OpenAI's name for a JSON schema or object constraint
            key, value = "structured", spec_from_response_format(value)
        kind = _NUMERIC_KEYS.get(key)
        if kind is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise RequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}")
            value = kind(value)
        elif key == "stop":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise RequestError("'stop' must be a string or a list of non-empty strings")
            value = tuple(value)
        elif key == "logit_bias" and not isinstance(value, dict):
            raise RequestError("'logit_bias' must be an object mapping token ids to biases")
        elif key == "lora" and not (isinstance(value, str) and value):
            raise RequestError("'lora' must name a LoRA adapter the engine was started with (--lora NAME=PATH)")
        values[key] = value
    try:
        return SamplingParams(**values)
    except PagecliError as exc:
        raise RequestError(str(exc)) from None


def _json_object(raw: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # "Invalid control character '\t' at": the column follows
        raise RequestError(f"invalid JSON ({what} at column {exc.colno})") from None
    except RecursionError:
        raise RequestError("invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise RequestError(f"invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise RequestError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _request_id(obj: dict[str, Any], default_id: str) -> str:
    request_id = obj.get("custom_id", obj.get("id", default_id))
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise RequestError("'id' must be a string or an integer")
    return str(request_id)


def _request_body(obj: dict[str, Any]) -> dict[str, Any]:
    """The request's fields: an OpenAI batch line's `body` (for an endpoint pagecli answers), or the line."""
    if "body" not in obj:
        return obj
    method, url = obj.get("method", "POST"), obj.get("url", OPENAI_BATCH_URLS[0])
    if method != "POST":
        raise RequestError(f"'method' must be POST for a batch request (got {json.dumps(method)})")
    if url not in OPENAI_BATCH_URLS:
        raise RequestError(f"'url' {json.dumps(url)} is not an endpoint pagecli answers; use "
                           f"{' or '.join(OPENAI_BATCH_URLS)}")
    if not isinstance(obj["body"], dict):
        raise RequestError("'body' must be a JSON object")
    return obj["body"]


def _prompt_of(body: dict[str, Any]) -> str | list[dict[str, Any]]:
    if "messages" in body:
        return read_messages(body["messages"])
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("'prompt' must be a string")
        if not prompt.strip():
            raise RequestError("'prompt' is empty")
        return prompt
    raise RequestError("needs a 'prompt' string or a 'messages' list")
