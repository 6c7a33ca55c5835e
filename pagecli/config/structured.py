"""What a request asks its output to follow (a JSON schema, any JSON object, a regex, a choice, a grammar),
and how OpenAI's `response_format` says it.

This is the request side only: plain data, validated for shape here; whether the schema or grammar
itself compiles is decided by the engine (pagecli/engine/structured.py) when the request is added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pagecli.errors import PagecliError, RequestError

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")


@dataclass(frozen=True)
class StructuredSpec:
    """One request's output constraint. `value` is text (hashable, so compiled grammars are cached by spec):

    - json_schema: the schema as JSON text;   - json_object: "" (any JSON object);
    - regex: the pattern;                      - choice: a tuple of strings, the output is one of them;
    - ebnf: a grammar in xgrammar's EBNF (`root ::= ...`);
    - structural_tag: an xgrammar structural tag as JSON text (tool-call formats: tags around schemas).
    """

    kind: StructuredKind
    value: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)} "
                               f"(got {self.kind!r}).")
        if isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))
        if self.kind == "choice":
            if not (isinstance(self.value, tuple) and self.value and all(isinstance(c, str) and c for c in self.value)):
                raise RequestError("a choice constraint needs a non-empty list of non-empty strings.")
        elif not isinstance(self.value, str):
            raise RequestError(f"a {self.kind} constraint's value must be text (got {type(self.value).__name__}).")
        elif self.kind != "json_object" and not self.value.strip():
            raise RequestError(f"a {self.kind} constraint needs a non-empty value.")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> StructuredSpec:
        """From a schema object or its JSON text (checked to be JSON: an object or a boolean)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: it is the output order
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise RequestError(f"the JSON schema is not valid JSON ({exc}).") from None
        if not isinstance(parsed, (dict, bool)):
            raise RequestError(f"a JSON schema must be a JSON object (got {type(parsed).__name__}).")
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object", "")

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredSpec:
        return cls("choice", tuple(options))


def spec_from_response_format(response_format: Any) -> StructuredSpec | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
    Anything else is this request's RequestError naming what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise RequestError("response_format must be an object such as {\"type\": \"json_object\"}.")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind != "json_schema":
        raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r}).")
    inner = response_format.get("json_schema")
    if not isinstance(inner, dict):
        raise RequestError("response_format of type 'json_schema' needs a 'json_schema' object "
                           "with 'name' and 'schema'.")
    if "schema" not in inner:
        raise RequestError("response_format.json_schema has no 'schema'.")
    if not isinstance(inner["schema"], (dict, bool)):
        raise RequestError("response_format.json_schema.schema must be a JSON object.")
    return StructuredSpec.json_schema(inner["schema"])


MAX_SCHEMA_FILE_BYTES = 16 << 20


def spec_from_schema_file(path: str) -> StructuredSpec:
    """`--json-schema FILE` and chat's `/format FILE`: a JSON schema, or an OpenAI `response_format` object
    holding one. A file that cannot be read or is no schema is one sentence naming it."""
    try:
        with open(Path(path).expanduser(), "rb") as schema_file:
            data = schema_file.read(MAX_SCHEMA_FILE_BYTES + 1)  # bounded: /dev/zero is a file too
        if len(data) > MAX_SCHEMA_FILE_BYTES:
            raise PagecliError(f"JSON schema file '{path}' is larger than {MAX_SCHEMA_FILE_BYTES >> 20} MiB; a "
                               "schema that large is not one pagecli compiles.")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise PagecliError(f"JSON schema file '{path}' does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PagecliError(f"Cannot read JSON schema file '{path}': {getattr(exc, 'strerror', None) or exc}.") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise PagecliError(f"JSON schema file '{path}' is not valid JSON ({exc}).") from None
    try:
        if isinstance(schema, dict) and schema.get("type") in ("json_schema", "json_object"):
            return spec_from_response_format(schema)  # type: ignore[return-value] - None only for "text"
        return StructuredSpec.json_schema(schema)
    except RequestError as exc:
        raise PagecliError(f"JSON schema file '{path}': {exc}") from None
