"""Tool calls and reasoning read out of a model's reply: each format whole, malformed calls kept as
text, and a stream cut at any points reassembling to the whole reply's reading."""

from __future__ import annotations

import json
import random

import pytest

from pagecli.errors import RequestError
from pagecli.models.reasoning import prompt_opens_thinking, split_reasoning
from pagecli.models.tool_calls import (
    HERMES, LLAMA3_JSON, MISTRAL, ToolCallStream, new_call_id, parse_call_list, parse_reply, tool_format_of,
)
from pagecli.models.tools import calls_schema, read_tool_request, tools_in_system_message
from pagecli.serve.chat_output import ReplyRules, ReplyStream, message_of, whole_reply

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _calls(parsed):
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


@pytest.mark.parametrize("template, fmt", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", HERMES),
    ("{{- '<|python_tag|>' }}{{ '<|eot_id|>' }}", LLAMA3_JSON),
    ('{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}', LLAMA3_JSON),
    ("[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS][TOOL_CALLS]", MISTRAL),
    ("<|im_start|>{{ message.content }}<|im_end|>", HERMES),
    (None, HERMES),
])
def test_the_format_is_chosen_from_the_templates_markers(template, fmt):
    assert tool_format_of(template) == fmt


def test_hermes_calls_are_parsed_and_the_text_before_them_is_content():
    text = f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{\"name\": \"now\", \"arguments\": {{}}}}\n</tool_call>"
    parsed = parse_reply(text, HERMES)
    assert parsed.content == "Let me look."
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("now", {})]


def test_a_reply_without_calls_is_returned_exactly():
    text = "  Hello <b>there</b>\n\n"
    for fmt in (HERMES, LLAMA3_JSON, MISTRAL):
        assert parse_reply(text, fmt).content == text and not parse_reply(text, fmt).tool_calls


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {}, "extra": 1}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off by max_tokens
    '<tool_call>["f"]</tool_call>',
])
def test_a_call_that_does_not_parse_stays_in_the_content_word_for_word(block):
    text = f"Before {block} after"
    parsed = parse_reply(text, HERMES)
    assert parsed.content == text and parsed.tool_calls == ()


def test_a_bad_block_beside_a_good_one_is_kept_and_the_good_one_parsed():
    text = f"<tool_call>{{oops}}</tool_call>\n<tool_call>{WEATHER}</tool_call>"
    parsed = parse_reply(text, HERMES)
    assert parsed.content == "<tool_call>{oops}</tool_call>"
    assert _calls(parsed) == [("get_weather", {"city": "Paris"})]


def test_an_unclosed_last_block_counts_when_its_json_is_whole():
    parsed = parse_reply(f"<tool_call>\n{WEATHER}\n", HERMES)
    assert parsed.content == "" and _calls(parsed) == [("get_weather", {"city": "Paris"})]


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    parsed = parse_reply('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', HERMES)
    assert _calls(parsed) == [("f", {"x": 2})]


@pytest.mark.parametrize("text, calls", [
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('\n{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"b": [1, 2]}}', [("f", {}), ("g", {"b": [1, 2]})]),
])
def test_llama3_json_calls(text, calls):
    parsed = parse_reply(text, LLAMA3_JSON)
    assert parsed.content == "" and _calls(parsed) == calls


@pytest.mark.parametrize("text", [
    'Here: {"name": "f", "parameters": {}}',  # a call only when the reply is one
    '{"name": "f", "parameters": {}} and then text',
    '{"answer": 42}',  # JSON that is not a call
    '{"name": "f", "parameters": {',
])
def test_llama3_text_that_is_not_wholly_calls_is_content(text):
    parsed = parse_reply(text, LLAMA3_JSON)
    assert parsed.content == text and parsed.tool_calls == ()


@pytest.mark.parametrize("text, content", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', ""),
    ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', "Sure."),
    ('[{"name": "f", "arguments": {"a": 1}}]', ""),  # [TOOL_CALLS] is a special token the detokenizer drops
])
def test_mistral_calls(text, content):
    parsed = parse_reply(text, MISTRAL)
    assert parsed.content == content and _calls(parsed) == [("f", {"a": 1})]


@pytest.mark.parametrize("text", ['[TOOL_CALLS][{"name": "f"', '[1, 2, 3]', '[TOOL_CALLS]not json'])
def test_mistral_text_that_does_not_parse_is_content(text):
    assert parse_reply(text, MISTRAL).content == text


def test_call_ids_are_call_random_and_nine_alphanumerics_for_mistral():
    assert new_call_id(HERMES).startswith("call_") and new_call_id(HERMES) != new_call_id(HERMES)
    mistral = new_call_id(MISTRAL)
    assert len(mistral) == 9 and mistral.isalnum()


def test_a_constrained_reply_is_a_json_list_of_calls():
    parsed = parse_call_list(' [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', HERMES)
    assert _calls(parsed) == [("f", {"a": 1}), ("g", {})]
    assert parse_call_list('[{"name": "f"', HERMES).content == '[{"name": "f"'


# --- reasoning ----------------------------------------------------------------------------------------


def test_think_at_the_start_is_reasoning_and_the_rest_content():
    split = split_reasoning("<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 4.")
    assert (split.reasoning, split.content, split.thinking_unfinished) == ("Step one.\nStep two.", "The answer is 4.", False)


def test_a_prompt_that_opened_think_makes_the_reply_start_in_reasoning():
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    split = split_reasoning("hmm\n</think>\nYes.", thinking_at_start=True)
    assert (split.reasoning, split.content) == ("hmm", "Yes.")


def test_a_reply_that_ends_while_thinking_has_no_content():
    split = split_reasoning("<think>still going")
    assert (split.reasoning, split.content, split.thinking_unfinished) == ("still going", "", True)


def test_think_later_in_an_answer_is_the_answers_text():
    text = "Use <think> tags like <think>this</think>."
    assert split_reasoning(text).reasoning is None and split_reasoning(text).content == text


# --- requests -----------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]


def test_tool_choice_values_are_read_and_mistakes_named():
    assert read_tool_request({"tools": TOOLS}).choice == "auto"
    assert read_tool_request({"tools": TOOLS, "tool_choice": "none"}).template_tools() is None
    named = read_tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert named.forced == "now" and named.constrained
    assert read_tool_request({}) is None
    for body, words in [
        ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
        ({"tool_choice": "required"}, "no 'tools'"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "two tools are named 'now'"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]:
        with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
            read_tool_request(body)


def test_the_calls_schema_allows_the_named_function_only_and_one_call_without_parallel_calls():
    schema = calls_schema(read_tool_request({"tools": TOOLS, "tool_choice": "required"}))
    assert schema["minItems"] == 1 and "maxItems" not in schema and len(schema["items"]["anyOf"]) == 2
    named = calls_schema(read_tool_request({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                            "function": {"name": "get_weather"}}}))
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"] == {"const": "get_weather"}
    assert named["items"]["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    single = calls_schema(read_tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}))
    assert single["maxItems"] == 1


def test_tools_are_described_in_the_system_message_for_a_template_without_tools():
    out = tools_in_system_message([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\n") and "get_weather" in out[0]["content"] and len(out) == 2
    assert tools_in_system_message([{"role": "user", "content": "hi"}], TOOLS)[0]["role"] == "system"


# --- streaming reassembles to the whole reply ---------------------------------------------------------

REPLIES = [
    f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
    f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>",
    "Plain answer with a < sign and <tool_ mention.",
    "<tool_call>{broken</tool_call> but said anyway",
    "<think>never finishes",
    "  <thinking> is not think",
    f"Two:\n<tool_call>{WEATHER}</tool_call>\ntext between\n<tool_call>{WEATHER}</tool_call>\n",
    '{"name": "f", "parameters": {"a": 1}}',
    '[TOOL_CALLS][{"name": "f", "arguments": {}}]',
    "[not a call] but text",
    "",
]


def _streamed(rules, text, cuts):
    stream, deltas = ReplyStream(rules), []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        deltas += stream.feed(text[start:end], 1)
    rest, reason = stream.finish("stop")
    return message_of(deltas + rest), reason


def _without_ids(message):
    for call in message.get("tool_calls", ()):
        call["id"] = "ID"
    return message


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("reasoning", [True, False])
def test_a_stream_cut_anywhere_reassembles_to_the_whole_reply(fmt, reasoning):
    rules, rng = ReplyRules(reasoning=reasoning, tool_format=fmt), random.Random(7)
    for text in REPLIES:
        whole, whole_reason, _ = whole_reply(rules, text, "stop")
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(0, 8), max(len(text) - 1, 0))))
            streamed, reason = _streamed(rules, text, cuts)
            assert _without_ids(streamed) == _without_ids(dict(whole)) and reason == whole_reason, (text, cuts)


def test_content_before_a_call_streams_before_the_reply_ends_and_the_marker_is_held():
    stream = ToolCallStream(HERMES)
    assert stream.feed("Checking the weather") == "Checking the weather"
    assert stream.feed(" now <tool") == " now"  # the space waits for what follows; "<tool" may be a marker
    assert stream.feed("_call>{") == ""
    assert stream.feed(WEATHER[1:] + "</tool_call>") == ""
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]


def test_streamed_calls_come_as_openai_deltas_name_first_then_arguments():
    stream = ReplyStream(ReplyRules(tool_format=HERMES))
    deltas = stream.feed(f"<tool_call>{WEATHER}</tool_call>")
    rest, reason = stream.finish("stop")
    calls = [d["tool_calls"][0] for d in deltas + rest if "tool_calls" in d]
    assert reason == "tool_calls" and len(calls) == 2
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"} and "id" not in calls[1]


def test_running_out_of_tokens_while_thinking_says_length_with_empty_content_and_counts_the_tokens():
    stream = ReplyStream(ReplyRules(reasoning=True))
    deltas = stream.feed("<think>", 1) + stream.feed("a long", 1) + stream.feed(" thought", 1)
    rest, reason = stream.finish("length")
    message = message_of(deltas + rest)
    assert reason == "length" and message["content"] == "" and message["reasoning_content"] == "a long thought"
    assert stream.reasoning_tokens == 3


def test_reasoning_tokens_count_the_thinking_only():
    stream = ReplyStream(ReplyRules(reasoning=True))
    for piece in ["<", "think>", "x", "</think>", "Answer", " here"]:
        stream.feed(piece, 1)
    assert stream.reasoning_tokens == 4


def test_the_finish_reason_stays_length_when_a_call_was_cut_off():
    _, reason, _ = whole_reply(ReplyRules(tool_format=HERMES), '<tool_call>{"name": "f", "argu', "length")
    assert reason == "length"
