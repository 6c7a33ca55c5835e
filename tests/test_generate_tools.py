"""Tools in `generate`'s JSONL and OpenAI batch lines: the line's tools reach the chat template, a forced
tool_choice constrains the reply, and the record gets the reply's calls beside its text."""

from __future__ import annotations

import json

import pytest

from pagecli.cli import main
from pagecli.batch.requests import BadLine, BatchRequest, parse_json_line
from pagecli.batch.line_results import LineResults
from pagecli.batch.line_tools import record_fields
from pagecli.engine import RequestEvent
from pagecli.models.messages import Conversation

TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
    "additionalProperties": False}}}]
HI = [{"role": "user", "content": "Pick a color."}]


def _line(**body):
    return parse_json_line(json.dumps({"messages": HI, **body}), 1)


def test_a_line_with_tools_carries_them_to_the_template_and_required_gets_a_grammar():
    auto = _line(tools=TOOLS)
    assert isinstance(auto, BatchRequest) and isinstance(auto.prompt, Conversation)
    assert auto.prompt.tools == TOOLS and "structured" not in auto.sampling
    required = _line(tools=TOOLS, tool_choice="required")
    schema = json.loads(required.sampling["structured"].value)
    assert schema["items"]["properties"]["name"] == {"const": "pick"}
    batch = parse_json_line(json.dumps({"custom_id": "a", "body": {"messages": HI, "tools": TOOLS,
                                                                   "tool_choice": "none"}}), 2)
    assert batch.prompt.tools is None and batch.tools.choice == "none"


@pytest.mark.parametrize("body, words", [
    ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": "pick"}, "'tools' must be a list"),
])
def test_tool_mistakes_are_the_lines_error(body, words):
    bad = _line(**body)
    assert isinstance(bad, BadLine) and words in bad.error and bad.error.startswith("line 1: ")
    prompt_line = parse_json_line(json.dumps({"prompt": "hi", "tools": TOOLS}), 3)
    assert isinstance(prompt_line, BadLine) and "'messages'" in prompt_line.error


def test_the_record_of_a_reply_with_calls_has_tool_calls_content_and_finish_reason():
    results = LineResults()
    results.expect(1, "a", 1, record_fields(_line(tools=TOOLS).tools, "<tool_call>"))
    text = 'Sure.\n<tool_call>{"name": "pick", "arguments": {"color": "red"}}</tool_call>'
    record = results.add(1, RequestEvent("1", text, (1,), True, "stop", 3, 9, 0, None))
    assert record["text"] == text and record["content"] == "Sure." and record["finish_reason"] == "tool_calls"
    (call,) = record["tool_calls"]
    assert call["function"] == {"name": "pick", "arguments": '{"color": "red"}'} and call["id"].startswith("call_")
    assert record_fields(_line(tools=TOOLS, tool_choice="none").tools, "<tool_call>") is None


def test_a_record_without_calls_is_unchanged():
    results = LineResults()
    results.expect(1, "a", 1, record_fields(_line(tools=TOOLS).tools, None))
    record = results.add(1, RequestEvent("1", "No call here.", (1,), True, "stop", 3, 4, 0, None))
    assert record["text"] == "No call here." and "tool_calls" not in record and record["finish_reason"] == "stop"


@pytest.mark.slow  # a random tiny model fills the grammar's whitespace until max_tokens; SmolLM2 writes calls
def test_generate_with_tool_choice_required_writes_schema_valid_calls(smollm2_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"messages": HI, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "temperature": 0},
             {"messages": HI, "tools": TOOLS, "max_tokens": 4}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", str(src), "-o", str(dst), "-m", str(smollm2_dir)]) == 0
    forced, free = [json.loads(line) for line in dst.read_text().splitlines()]
    assert forced["finish_reason"] == "tool_calls", forced
    (call,) = forced["tool_calls"]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["color"] in ("red", "blue")
    assert "error" not in free and isinstance(free["text"], str)
