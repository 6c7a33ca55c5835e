"""`pagecli serve` answers Ollama's API as the official `ollama` client reads it: chat and generate,
streamed as NDJSON and not, format json and a schema, options, tools, Ollama's timing fields and token
counts, and the model listings (list, show, ps, version)."""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from serve_helpers import roomy_server

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
GREEDY = {"temperature": 0, "num_predict": 8}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module", name="server")
def _server(tiny_model_factory):
    with roomy_server(tiny_model_factory) as running:
        yield running


@pytest.fixture(scope="module")
def llama(server):
    return ollama.Client(host=server.base_url)


@pytest.fixture(scope="module")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat_text(openai_client, server, messages, max_tokens=8):
    reply = openai_client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=max_tokens,
                                                  temperature=0)
    return reply.choices[0].message.content


def test_chat_greedy_text_equals_chat_completions_with_ollamas_counts_and_timings(server, llama, openai_client):
    reply = llama.chat(model=server.model_id, messages=MESSAGES, options=GREEDY)
    assert reply.done and reply.done_reason in ("stop", "length") and reply.message.role == "assistant"
    assert reply.message.content == chat_text(openai_client, server, MESSAGES)
    assert reply.prompt_eval_count == len(server.engine.encode_chat(MESSAGES))
    assert 1 <= reply.eval_count <= 8
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0  # nanoseconds
    assert reply.total_duration < 60e9
    tagged = llama.chat(model=server.model_id + ":latest", messages=MESSAGES, options=GREEDY)
    assert tagged.message.content == reply.message.content


def test_chat_streams_ndjson_lines_that_add_up_to_the_whole_reply(server, llama):
    whole = llama.chat(model=server.model_id, messages=MESSAGES, options={"temperature": 0, "num_predict": 12})
    parts = list(llama.chat(model=server.model_id, messages=MESSAGES, options={"temperature": 0, "num_predict": 12},
                            stream=True))
    assert all(not part.done for part in parts[:-1]) and parts[-1].done
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_generate_applies_the_chat_template_unless_raw(server, llama, openai_client):
    reply = llama.generate(model=server.model_id, prompt="Hello there!", system="You are terse.", options=GREEDY)
    assert reply.response == chat_text(openai_client, server, MESSAGES)
    streamed = list(llama.generate(model=server.model_id, prompt="Hello there!", system="You are terse.",
                                   options=GREEDY, stream=True))
    assert "".join(part.response for part in streamed) == reply.response and streamed[-1].done
    raw = llama.generate(model=server.model_id, prompt="The quick brown fox", raw=True, options=GREEDY)
    completion = openai_client.completions.create(model=server.model_id, prompt="The quick brown fox", max_tokens=8,
                                                  temperature=0)
    assert raw.response == completion.choices[0].text
    assert raw.prompt_eval_count == completion.usage.prompt_tokens


def test_options_are_honoured(server, llama):
    short = llama.generate(model=server.model_id, prompt="Count", options={"temperature": 0, "num_predict": 3})
    assert short.eval_count == 3 and short.done_reason == "length"
    sampled = dict(model=server.model_id, prompt="Count", options={"temperature": 1.0, "top_p": 0.9, "top_k": 20,
                                                                   "seed": 7, "num_predict": 10})
    assert llama.generate(**sampled).response == llama.generate(**sampled).response
    text = llama.generate(model=server.model_id, prompt="Count", options={"temperature": 0, "num_predict": 20}).response
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = llama.generate(model=server.model_id, prompt="Count",
                             options={"temperature": 0, "num_predict": 20, "stop": [stop]})
    assert stopped.response == text[: text.index(stop)]


def test_format_json_and_a_schema_are_enforced(server, llama):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = llama.chat(model=server.model_id, messages=[{"role": "user", "content": "Is the sky blue?"}],
                       format=schema, options={"temperature": 1.0, "seed": 1, "num_predict": 1500})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), schema)
    as_json = llama.generate(model=server.model_id, prompt="Some JSON", format="json",
                             options={"temperature": 1.0, "seed": 1, "num_predict": 1500})
    assert as_json.done_reason == "stop" and isinstance(json.loads(as_json.response), dict)


def test_tools_come_back_as_ollama_tool_calls_and_results_go_back_in(server, llama):
    # Ollama's API has no tool_choice: a random model, offered a tool, answers in text; the server reads the
    # model's <tool_call> blocks, which a template-trained model writes. Here the reply is read, whatever it is.
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    reply = llama.chat(model=server.model_id, messages=ask, tools=[WEATHER], options=GREEDY)
    assert reply.done and reply.prompt_eval_count > len(server.engine.encode_chat(ask))  # the tool is in the prompt
    history = ask + [{"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    follow = llama.chat(model=server.model_id, messages=history, tools=[WEATHER], options=GREEDY)
    assert follow.done and follow.prompt_eval_count > reply.prompt_eval_count


def test_list_show_ps_and_version_describe_the_served_model(server, llama):
    listed = llama.list().models
    assert [m.model for m in listed] == [server.model_id] and listed[0].size > 0
    assert listed[0].details.family == "llama" and listed[0].details.parameter_size
    shown = llama.show(server.model_id)
    assert shown.modelinfo["general.architecture"] == "llama" and shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo["llama.context_length"] == server.engine.max_model_len
    running = llama.ps().models
    assert [m.model for m in running] == [server.model_id] and running[0].context_length == server.engine.max_model_len
    import httpx

    assert httpx.get(server.base_url + "/api/version").json()["version"]


def test_what_cannot_be_honoured_is_an_error_naming_it(server, llama):
    for call, says in [
        (lambda: llama.chat(model=server.model_id, messages=MESSAGES, options={"num_ctx": 8192}), "num_ctx"),
        (lambda: llama.generate(model=server.model_id, prompt="Hi", images=["aGVsbG8="]), "images"),
        (lambda: llama.generate(model=server.model_id, prompt="Hi", suffix="end"), "suffix"),
        (lambda: llama.chat(model=server.model_id, messages=MESSAGES, keep_alive=0), "keep_alive"),
        (lambda: llama.chat(model="llama3:8b", messages=MESSAGES), "llama3:8b"),
    ]:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert says in caught.value.error and 400 <= caught.value.status_code < 500
