"""`pagecli serve` answers OpenAI's Responses API as the official client reads it: text and message input,
instructions, the typed stream, a JSON schema through the structured-output path, function tools with
tool_choice, and previous_response_id continued from memory with its cached tokens reported."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from serve_helpers import client, roomy_server  # noqa: F401 - client: the module's OpenAI client



@pytest.fixture(scope="module", name="server")
def _server(tiny_model_factory):
    with roomy_server(tiny_model_factory) as running:
        yield running


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                          "additionalProperties": False}}


def chat_text(client, server, messages, max_tokens=8):
    reply = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=max_tokens,
                                           temperature=0)
    return reply.choices[0].message.content


def test_greedy_text_equals_chat_completions_for_the_same_conversation(server, client):
    response = client.responses.create(model=server.model_id, instructions="You are terse.", input="Hello there!",
                                       max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat_text(client, server, MESSAGES)
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"
    assert response.usage.input_tokens == len(server.engine.encode_chat(MESSAGES))
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status in ("completed", "incomplete")
    items = client.responses.create(model=server.model_id, max_output_tokens=8, temperature=0, input=[
        {"role": "system", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there!"}]}])
    assert items.output_text == response.output_text


def test_the_stream_is_the_typed_event_sequence_and_adds_up_to_the_whole_response(server, client):
    whole = client.responses.create(model=server.model_id, input="Tell me a story", max_output_tokens=10,
                                    temperature=0)
    events = list(client.responses.create(model=server.model_id, input="Tell me a story", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_length_cut_reply_is_incomplete_with_its_reason(server, client):
    response = client.responses.create(model=server.model_id, input="Count to a hundred", max_output_tokens=1,
                                       temperature=0)
    assert response.usage.output_tokens == 1
    if response.status == "incomplete":  # a one-token reply that was the end of the turn is complete
        assert response.incomplete_details.reason == "max_output_tokens"


SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
         "required": ["ok", "n"], "additionalProperties": False}


class Small(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=99)


def test_a_json_schema_in_text_format_is_enforced_streamed_and_not(server, client):
    fmt = {"format": {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}}
    response = client.responses.create(model=server.model_id, input="Is the sky blue? Answer in JSON.", text=fmt,
                                       max_output_tokens=2000, temperature=0)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SMALL)
    streamed = list(client.responses.create(model=server.model_id, input="Is the sky blue? Answer in JSON.",
                                            text=fmt, max_output_tokens=2000, temperature=0, stream=True))
    assert streamed[-1].response.output_text == response.output_text
    parsed = client.responses.parse(model=server.model_id, input="Is the sky blue? Answer in JSON.",
                                    text_format=Small, max_output_tokens=2000, temperature=0)
    assert isinstance(parsed.output_parsed, Small)


def test_a_required_tool_comes_back_as_a_function_call_and_its_output_continues_the_conversation(server, client):
    sampled = dict(temperature=1.0, extra_body={"seed": 1})  # greedy, a random model writes whitespace forever
    response = client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=2000, **sampled)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = list(client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=2000, stream=True, **sampled))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    follow = client.responses.create(model=server.model_id, previous_response_id=response.id, tools=[WEATHER],
                                     max_output_tokens=6, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny, 21 C"}])
    assert follow.previous_response_id == response.id
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt came from the cache
    none = client.responses.create(model=server.model_id, input="Weather in Paris?", tools=[WEATHER],
                                   tool_choice="none", max_output_tokens=6, temperature=0)
    assert [item.type for item in none.output] == ["message"]


def test_previous_response_id_continues_from_the_cache_as_the_whole_conversation_would(server, client):
    first = client.responses.create(model=server.model_id, input="Paged attention keeps the cache in blocks. " * 3,
                                    max_output_tokens=6, temperature=0)
    second = client.responses.create(model=server.model_id, previous_response_id=first.id, input="And then?",
                                     max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= server.engine.config.block_size * 2
    whole = client.responses.create(model=server.model_id, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Paged attention keeps the cache in blocks. " * 3},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}])
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_a_missing_previous_response_is_a_404_in_openais_shape(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=server.model_id, input="Hi", previous_response_id="resp_nope")
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"


def test_the_store_keeps_a_bounded_number_of_responses_for_a_bounded_time():
    from pagecli.serve.response_store import ResponseStore

    store = ResponseStore(max_count=3, max_age_s=60)
    for number in range(5):
        store.put(f"r{number}", [{"role": "user", "content": str(number)}], {})
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    stale = ResponseStore(max_count=3, max_age_s=0)
    stale.put("old", [], {})
    assert stale.get("old") is None
