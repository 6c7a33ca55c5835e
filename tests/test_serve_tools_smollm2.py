"""Tool calling on the embedded SmolLM2 through `pagecli serve` and the official openai client: with
tool_choice "required" every reply is a call to one of the tools with arguments that follow its schema;
with "none" never a call; a streamed call reassembles to the non-streamed one."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from pagecli.config import SamplingParams
from serve_helpers import checked_idle, running_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTIONS = ["What's the weather in Paris?", "What time is it in Tokyo?", "Is it raining in London?",
             "Tell me the time in New York.", "How hot is it in Cairo today?", "Hello!"]


@pytest.fixture(scope="module")
def client(smollm2_dir):
    threads = torch.get_num_threads()
    with running_server(smollm2_dir, sampling=SamplingParams(temperature=0, max_tokens=64), num_blocks=256) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0), server.model_id
        checked_idle(server)
    torch.set_num_threads(threads)


def _ask(question):
    return [{"role": "user", "content": question}]


def test_required_gives_a_schema_valid_call_to_one_of_the_tools_every_time(client):
    client, model = client
    for question in QUESTIONS:
        choice = client.chat.completions.create(model=model, messages=_ask(question), tools=TOOLS,
                                                tool_choice="required", temperature=0.8, seed=1,
                                                parallel_tool_calls=False, max_tokens=256).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_the_one_called(client):
    client, model = client
    choice = client.chat.completions.create(
        model=model, messages=_ask("What's the weather in Paris?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=256).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_none_never_gives_a_call(client):
    client, model = client
    for question in QUESTIONS[:3]:
        choice = client.chat.completions.create(model=model, messages=_ask(question), tools=TOOLS,
                                                tool_choice="none").choices[0]
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
        assert choice.message.content


def test_streamed_calls_reassemble_to_the_non_streamed_ones(client):
    client, model = client
    request = dict(model=model, messages=_ask("What's the weather in Paris?"), tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, max_tokens=256)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    calls, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for part in chunk.choices[0].delta.tool_calls or ():
            if part.index == len(calls):
                calls.append([part.function.name, part.function.arguments or ""])
            else:
                calls[part.index][1] += part.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls"
    assert calls == [[c.function.name, c.function.arguments] for c in whole]
