"""`pagecli serve` answers Anthropic's Messages API as the official `anthropic` client reads it: system and
content blocks, Anthropic's stream event sequence, tools with tool_choice and a tool_use / tool_result round
trip, stop_sequences with the one that stopped the reply, usage with cache reads, and count_tokens."""

from __future__ import annotations

import anthropic
import pytest

from pagecli.config import SamplingParams
from serve_helpers import roomy_server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
# This client version sends no sampling fields (the API still reads temperature, top_p and top_k): requests
# here are greedy, the server's default, and the sampled ones send temperature through extra_body. Greedy,
# a random model writes whitespace into a JSON tool call until the token limit.
SAMPLED = {"temperature": 1.0}


@pytest.fixture(scope="module", name="server")
def _server(tiny_model_factory):
    # Seeded under every request, so a sampled request (the tool round trip) is reproducible: Anthropic's API
    # has no seed field. Greedy requests are unaffected.
    with roomy_server(tiny_model_factory, sampling=SamplingParams(max_tokens=8, seed=1)) as running:
        yield running


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat_text(openai_client, server, messages, max_tokens=8, **fields):
    reply = openai_client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=max_tokens,
                                                  **fields)
    return reply.choices[0].message.content


def test_greedy_text_equals_chat_completions_and_usage_counts_cache_reads_apart(server, claude, openai_client):
    message = claude.messages.create(model=server.model_id, max_tokens=8, system="You are terse.",
                                     messages=[{"role": "user", "content": "Hello there!"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat_text(openai_client, server, MESSAGES)
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(server.engine.encode_chat(MESSAGES))
    assert 1 <= usage.output_tokens <= 8
    again = claude.messages.create(model=server.model_id, max_tokens=8,
                                   system=[{"type": "text", "text": "You are terse."}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}])
    assert again.content[0].text == message.content[0].text
    assert again.usage.cache_read_input_tokens >= server.engine.config.block_size  # the same prompt, cached


def test_the_stream_is_anthropics_event_sequence_and_adds_up_to_the_whole_message(server, claude):
    ask = dict(model=server.model_id, max_tokens=12, messages=[{"role": "user", "content": "Go on"}])
    whole = claude.messages.create(**ask)
    events = list(claude.messages.create(**ask, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == text
        assert stream.get_final_message().content[0].text == text


def test_a_tool_use_round_trip(server, claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model=server.model_id, max_tokens=1500, tools=[WEATHER], extra_body=SAMPLED,
                                   tool_choice={"type": "any"}, messages=ask)
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"} for use in uses]
    second = claude.messages.create(model=server.model_id, max_tokens=8, tools=[WEATHER],
                                    messages=ask + [{"role": "assistant", "content": first.content},
                                                    {"role": "user", "content": results}])
    assert second.usage.cache_read_input_tokens >= server.engine.config.block_size  # the first turn's prompt
    streamed = list(claude.messages.create(model=server.model_id, max_tokens=1500, tools=[WEATHER], extra_body=SAMPLED,
                                           tool_choice={"type": "tool", "name": "get_weather"}, messages=ask,
                                           stream=True))
    starts = [e.content_block for e in streamed if e.type == "content_block_start"]
    assert starts[0].type == "tool_use" and starts[0].name == "get_weather"
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in streamed)
    none = claude.messages.create(model=server.model_id, max_tokens=6, tools=[WEATHER],
                                  tool_choice={"type": "none"}, messages=ask)
    assert [block.type for block in none.content] == ["text"] and none.stop_reason != "tool_use"


def test_stop_sequences_stop_the_reply_and_say_which_one(server, claude):
    ask = dict(model=server.model_id, messages=[{"role": "user", "content": "Tell me more"}])
    text = claude.messages.create(max_tokens=30, **ask).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"the reply {text!r} has no characters to stop on"
    earlier = text[: text.index(stop)]
    message = claude.messages.create(max_tokens=30, stop_sequences=["never-there", stop], **ask)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == earlier
    plain = claude.messages.create(max_tokens=30, stop_sequences=["never-there"], **ask)
    assert plain.stop_sequence is None and plain.stop_reason in ("end_turn", "max_tokens")


def test_output_config_format_is_a_json_schema_the_reply_follows(server, claude):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = claude.messages.create(model=server.model_id, max_tokens=1500, extra_body=SAMPLED,
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": "Is the sky blue?"}])
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_counts_the_prompt_the_engine_would_run(server, claude):
    counted = claude.messages.count_tokens(model=server.model_id, system="You are terse.",
                                           messages=[{"role": "user", "content": "Hello there!"}])
    assert counted.input_tokens == len(server.engine.encode_chat(MESSAGES))
    with_tools = claude.messages.count_tokens(model=server.model_id, tools=[WEATHER],
                                              messages=[{"role": "user", "content": "Hello there!"}])
    assert with_tools.input_tokens > counted.input_tokens


def test_mistakes_are_errors_in_anthropics_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=server.model_id, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert caught.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                            "message": caught.value.body["error"]["message"]}}
    assert "web_search" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus-4", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
