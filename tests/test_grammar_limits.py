"""A constraint the grammar engine would compile with a rule dropped is refused by name, with no raw C++
warning on stderr; one too large or too slow to compile is refused before or at its deadline."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from pagecli.config.structured import StructuredSpec
from pagecli.engine import grammar_limits
from pagecli.engine.grammar_limits import compile_bounded, regex_problem
from pagecli.engine.structured import GrammarCompiler
from pagecli.errors import RequestError
from pagecli.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def compiler(tiny_llama):
    tokenizer = load_tokenizer(tiny_llama)
    return GrammarCompiler(tokenizer, len(tokenizer.get_vocab()), frozenset({tokenizer.eos_token_id}))


def schema(value: dict) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps(value))


@pytest.mark.parametrize(("value", "named"), [
    ({"type": "string", "pattern": "a+", "minLength": 3}, "'minLength' together with 'pattern'"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, "'maxLength' together with 'pattern'"),
    ({"type": "string", "format": "email", "maxLength": 30}, "'maxLength' together with 'format'"),
    ({"type": "integer", "minimum": 0, "multipleOf": 5}, "'multipleOf' with only a lower or only an upper bound"),
    ({"type": "integer", "exclusiveMaximum": 9, "multipleOf": 5}, "only a lower or only an upper bound"),
    ({"type": "integer", "multipleOf": 2.5}, "'multipleOf' that is not an integer"),
    ({"type": "string", "pattern": "a(?=b)"}, "a lookahead of 'pattern'"),
    ({"type": "string", "pattern": "(?!a)b"}, "a lookahead of 'pattern'"),
    ({"type": "string", "pattern": "a|^b"}, "'^' in the middle of 'pattern'"),
    ({"type": "string", "pattern": "a$b"}, "'$' in the middle of 'pattern'"),
    ({"$defs": {"a": {"$anchor": "x", "type": "string"}}, "$ref": "#x"}, "'$ref' to '#x'"),
    ({"$ref": "https://example.com/schema.json"}, "'$ref' to 'https://example.com/schema.json'"),
    ({"$dynamicRef": "#"}, "'$dynamicRef'"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x", "minLength": 1}}},
     "at #/properties/a"),
])
def test_a_schema_rule_the_engine_would_drop_is_refused_by_name_with_no_native_warning(compiler, value, named,
                                                                                       capfd):
    with pytest.raises(RequestError, match=re.escape(named)):
        compiler.compile(schema(value))
    assert "Warning" not in capfd.readouterr().err


def test_a_dropped_rule_the_checks_do_not_know_is_refused_with_the_engines_own_words(compiler, capfd):
    # A lookahead in a patternProperties name: only xgrammar's warning tells, and it becomes the refusal.
    spec = schema({"type": "object", "patternProperties": {"a(?=b)": {"type": "string"}}})
    with pytest.raises(RequestError, match="cannot enforce and would drop .Lookahead assertion is not supported"):
        compiler.compile(spec)
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.parametrize("value", [
    {"type": "string", "pattern": "^[a-z]+$"}, {"type": "string", "pattern": "[$^]+"},
    {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}, {"type": "integer", "multipleOf": 3},
    {"type": "string", "minLength": 2, "maxLength": 40}, {"type": "string", "format": "date"},
    {"$defs": {"name": {"type": "string"}}, "type": "object", "properties": {"n": {"$ref": "#/$defs/name"}}},
])
def test_rules_the_engine_enforces_still_compile(compiler, value, capfd):
    compiler.compile(schema(value))
    assert "Warning" not in capfd.readouterr().err


def test_a_regex_constraint_with_a_lookahead_is_refused(compiler):
    with pytest.raises(RequestError, match="the regex constraint uses a lookahead"):
        compiler.compile(StructuredSpec("regex", "a(?=b)c"))


@pytest.mark.parametrize(("spec", "words"), [
    (schema({"type": "string", "maxLength": 1_000_000}), "'maxLength' at # is 1,000,000; at most 100,000"),
    (schema({"type": "array", "items": {"type": "integer"}, "minItems": 10 ** 7}), "'minItems' at # is 10,000,000"),
    (StructuredSpec("regex", "[a-z]{1,20000}"), "repeat 20,000 times in all"),
    (schema({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}"}
                                              for i in range(300)}}), "repeat 44,850 times in all"),
    (schema({"enum": [f"value-{i}" for i in range(30_000)]}), "characters long; at most 262,144"),
])
def test_a_constraint_too_large_to_compile_quickly_is_refused_before_compiling(compiler, spec, words):
    start = time.monotonic()
    with pytest.raises(RequestError, match=re.escape(words)):
        compiler.compile(spec)
    assert time.monotonic() - start < 1


def test_a_compile_past_its_deadline_fails_its_request(monkeypatch):
    monkeypatch.setattr(grammar_limits, "COMPILE_TIME_S", 0.2)
    start = time.monotonic()
    with pytest.raises(RequestError, match="took longer than 0.2 s to compile"):
        compile_bounded("regex", lambda: time.sleep(2))
    assert time.monotonic() - start < 1.5


def test_a_compiled_grammar_past_the_size_limit_is_refused():
    class Huge:
        memory_size_bytes = grammar_limits.MAX_COMPILED_BYTES + 1

    with pytest.raises(RequestError, match="MiB of token masks"):
        compile_bounded("ebnf", Huge)


def test_native_warnings_are_captured_and_other_stderr_lines_pass_through(capfd):
    def compile_that_warns():
        os.write(2, b"[12:00:00] /project/cpp/x.cc:1: Warning: something is ignored\nanother thread's line\n")
        return object()

    with pytest.raises(RequestError, match=r"would drop \(something is ignored\)"):
        compile_bounded("ebnf", compile_that_warns)
    err = capfd.readouterr().err
    assert "another thread's line" in err and "Warning" not in err


@pytest.mark.parametrize(("regex", "problem"), [
    ("^abc$", None), ("[^a]", None), (r"a\$b", None), (r"a\^", None), ("[]^]", None), ("(?:ab)+", None),
    ("a(?<=b)", "a lookbehind"), ("a(?<!b)", "a lookbehind"), ("(a)^", "'^' in the middle"),
])
def test_regex_problem_sees_anchors_and_lookarounds_outside_classes_and_escapes(regex, problem):
    assert regex_problem(regex) == problem

