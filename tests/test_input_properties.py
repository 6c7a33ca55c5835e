"""Property tests (hypothesis): random bytes, random JSON and random JSON schemas given to the input line reader,
the batch line parser, the schema compiler and the session loader; nothing but pagecli's own errors escapes."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagecli.chat.session import read_session_file
from pagecli.batch.requests import BadLine, BatchRequest, parse_requests
from pagecli.batch.input_lines import read_lines
from pagecli.config.structured import StructuredSpec
from pagecli.engine.structured import GrammarCompiler
from pagecli.errors import PagecliError
from pagecli.models.loader import load_tokenizer

json_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats() | st.text(max_size=10))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
BOMS = [b"", b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"]
input_bytes = st.builds(lambda bom, body: bom + body, st.sampled_from(BOMS), st.binary(max_size=300)) | \
    st.lists(json_values.map(lambda v: json.dumps(v).encode()), max_size=5).map(b"\n".join)


@settings(max_examples=300, deadline=None)
@given(input_bytes, st.integers(1, 400))
def test_any_bytes_read_as_lines_within_the_limit_or_one_pagecli_error(data, max_line_bytes):
    try:
        lines = read_lines(io.BytesIO(data), "input.jsonl", max_line_bytes)
    except PagecliError as error:
        assert str(error)
        return
    assert all(isinstance(line, str) and "\n" not in line for line in lines)
    for item in parse_requests(lines, "jsonl"):
        assert isinstance(item, (BatchRequest, BadLine))


# --- schemas --------------------------------------------------------------------------------------------------
names = st.sampled_from(["a", "b", "id", "$defs", "x y", ""])
keywords = st.sampled_from([
    "type", "properties", "items", "prefixItems", "required", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
    "$defs", "definitions", "additionalProperties", "pattern", "minLength", "maxLength", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "format", "patternProperties",
    "propertyNames", "not", "uniqueItems", "minProperties", "maxProperties", "nullable", "default",
])
keyword_values = (json_values | st.sampled_from(["string", "integer", "number", "object", "array", "boolean", "null",
                                                 "#", "#/$defs/a", "#/properties/a", "a+", "^x$", "(?=a)", "[",
                                                 "email", "date", "uuid"])
                  | st.integers(-3, 10 ** 7) | st.lists(st.sampled_from(["a", "b"]), max_size=2))
schemas = st.recursive(
    st.dictionaries(keywords, keyword_values, max_size=4),
    lambda inner: st.dictionaries(keywords, inner | keyword_values | st.dictionaries(names, inner, max_size=3)
                                  | st.lists(inner, max_size=3), max_size=4),
    max_leaves=10)


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    tokenizer = load_tokenizer(tiny_llama)
    return GrammarCompiler(tokenizer, len(tokenizer.get_vocab()), frozenset({tokenizer.eos_token_id}))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas | json_values)
def test_any_json_schema_compiles_or_is_refused_with_a_pagecli_error(compiler, schema, capfd):
    try:
        compiler.compile(StructuredSpec("json_schema", json.dumps(schema)))
    except PagecliError as error:
        assert str(error)
    assert "Warning" not in capfd.readouterr().err  # a dropped rule never passes with only a C++ warning


# --- sessions -------------------------------------------------------------------------------------------------
texts = st.text(max_size=8) | json_values
turns = st.lists(st.fixed_dictionaries({"user": texts}, optional={"assistant": texts, "finish_reason": texts}),
                 max_size=3)
prefixes = st.lists(st.fixed_dictionaries({}, optional={
    "text": texts, "token_ids": st.lists(st.integers(-5, 2 ** 70), max_size=4) | json_values}), max_size=2)
sessions = st.fixed_dictionaries({}, optional={
    "format": st.integers(-1, 3) | json_values, "system": texts, "turns": turns | json_values,
    "turns_total": st.integers(-(2 ** 70), 2 ** 70) | json_values, "model": texts, "name": texts, "updated": texts,
    "known_prefixes": st.fixed_dictionaries({}, optional={"fingerprint": texts, "prefixes": prefixes | json_values})
    | json_values})
session_files = (sessions.map(lambda s: json.dumps(s).encode()) | json_values.map(lambda v: json.dumps(v).encode())
                 | st.binary(max_size=200))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=session_files)
def test_any_session_file_loads_or_is_refused_with_a_pagecli_error(tmp_path, data):
    path = tmp_path / "s.json"
    path.write_bytes(data)
    try:
        session = read_session_file(path)
    except PagecliError as error:
        assert "s.json" in str(error)
        return
    assert session.conversation is not None
