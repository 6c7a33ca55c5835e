"""Tool calling and reasoning through `pagecli serve`, read by the official openai client: a scripted
engine says exactly what the model "said", so each test checks how the server reads a reply."""

from __future__ import annotations

import json
import httpx
import openai
import pytest
from scripted_engine import CHATML_TOOLS_TEMPLATE, ScriptedEngine, scripted_server

from pagecli.models.messages import Conversation

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(["Hello."])


@pytest.fixture(scope="module")
def client(engine):
    with scripted_server(engine) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _streamed_message(client, **request):
    """The message and finish reason a stream reassembles to, as an OpenAI client adds up deltas."""
    content, reasoning, calls, reason = "", "", [], None
    for chunk in client.chat.completions.create(model="scripted", stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for part in delta.tool_calls or ():
            if part.index == len(calls):
                calls.append({"id": part.id, "name": part.function.name, "arguments": part.function.arguments or ""})
            else:
                calls[part.index]["arguments"] += part.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, reasoning, calls, reason


def _calls(message):
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]


def test_a_call_in_the_reply_comes_back_as_tool_calls_with_finish_reason_tool_calls(engine, client):
    engine.script("Let me check.\n\n" + CALL)
    reply = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = engine.prompts[-1]
    assert isinstance(prompt, Conversation) and prompt.tools == TOOLS  # the template is given the tools


def test_a_streamed_call_reassembles_to_the_same_call_and_content(engine, client):
    engine.script("Let me check.\n\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    whole = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS).choices[0]
    content, reasoning, calls, reason = _streamed_message(client, messages=ASK, tools=TOOLS)
    assert (content, reason) == (whole.message.content, whole.finish_reason) == ("Let me check.", "tool_calls")
    strip = [{**c, "id": None} for c in calls]
    assert strip == [{**c, "id": None} for c in _calls(whole.message)] and len(calls) == 2
    assert all(c["id"].startswith("call_") for c in calls)


def test_a_call_that_does_not_parse_is_returned_as_content(engine, client):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    engine.script(broken)
    choice = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS).choices[0]
    assert choice.message.content == broken and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert _streamed_message(client, messages=ASK, tools=TOOLS)[0] == broken


def test_tool_choice_none_never_returns_a_call_and_leaves_the_tools_out_of_the_prompt(engine, client):
    engine.script(CALL)
    choice = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert engine.prompts[-1].tools is None
    assert _streamed_message(client, messages=ASK, tools=TOOLS, tool_choice="none")[2] == []


def test_without_tools_a_call_shaped_reply_is_plain_content(engine, client):
    engine.script(CALL)
    choice = client.chat.completions.create(model="scripted", messages=ASK).choices[0]
    assert choice.message.content == CALL and choice.finish_reason == "stop"


def test_every_candidate_of_n_gets_its_calls(engine, client):
    engine.script(CALL)
    reply = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, n=2)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls"] * 2
    ids = {c.message.tool_calls[0].id for c in reply.choices}
    assert len(ids) == 2  # each call has its own id


def test_a_conversation_with_calls_and_results_is_accepted(engine, client):
    engine.script("It is 21 C in Paris.")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    choice = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS).choices[0]
    assert choice.message.content == "It is 21 C in Paris." and choice.finish_reason == "stop"
    assert engine.prompts[-1].messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_tool_mistakes_are_a_400_naming_the_field(client, body, param):
    response = httpx.post(str(client.base_url) + "chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400
    assert param in response.json()["error"]["message"]


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_required_and_a_named_function_constrain_the_reply_to_calls(engine, client, tool_choice, names):
    engine.script('[{"name": "get_time", "arguments": {}}]')
    choice = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                            tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_time"
    schema = json.loads(engine.samplings[-1].structured.value)
    items = schema["items"].get("anyOf", [schema["items"]])
    assert {item["properties"]["name"]["const"] for item in items} == names


# --- reasoning ----------------------------------------------------------------------------------------


def _post(client, **body):
    response = httpx.post(str(client.base_url) + "chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_thinking_comes_back_as_reasoning_content_beside_the_content(engine, client):
    engine.script("<think>\nThe user wants a greeting.\n</think>\n\nHello!")
    reply = _post(client)
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants a greeting." and message["content"] == "Hello!"
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 15  # 3 characters a token
    content, reasoning, _, reason = _streamed_message(client, messages=ASK)
    assert (content, reasoning, reason) == ("Hello!", "The user wants a greeting.", "stop")
    chunks = list(client.chat.completions.create(model="scripted", messages=ASK, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 15


def test_max_tokens_spent_thinking_says_length_with_empty_content(engine, client):
    engine.script("<think>\nLet me think about this for a long while...</think>Hi")
    reply = _post(client, max_tokens=5)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == "Let me"  # 5 tokens of 3 characters
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == reply["usage"]["completion_tokens"] == 5


def test_thinking_then_a_call(engine, client):
    engine.script("<think>I need the weather tool.</think>\n" + CALL)
    message = _post(client, tools=TOOLS)["choices"][0]["message"]
    assert message["reasoning_content"] == "I need the weather tool." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_reasoning_format_none_leaves_thinking_in_the_content():
    engine = ScriptedEngine(["<think>hmm</think>Hi"])
    with scripted_server(engine, reasoning_format="none") as url:
        reply = httpx.post(url + "/v1/chat/completions", json={"messages": ASK}).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "<think>hmm</think>Hi"}
    assert "completion_tokens_details" not in reply["usage"]


def test_a_template_whose_prompt_opens_think_starts_the_reply_in_reasoning():
    template = CHATML_TOOLS_TEMPLATE.replace("assistant\n", "assistant\n<think>\n")
    assert template != CHATML_TOOLS_TEMPLATE
    engine = ScriptedEngine(["weighing it\n</think>\nYes."], template)
    with scripted_server(engine) as url:
        message = httpx.post(url + "/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("weighing it", "Yes.")


@pytest.mark.parametrize("template, reply", [
    ("{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}",
     '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% for m in messages %}{{ m.content }}{% endfor %}",
     '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_llama3_and_mistral_templates_have_their_calls_read(template, reply):
    engine = ScriptedEngine([reply], template)
    with scripted_server(engine) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        choice = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS).choices[0]
        streamed = _streamed_message(client, messages=ASK, tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments) == {
        "city": "Paris"}
    assert streamed[2][0]["name"] == "get_weather" and streamed[3] == "tool_calls"


# --- the flag -----------------------------------------------------------------------------------------


def test_reasoning_format_flag_reaches_the_server_and_a_wrong_value_is_one_line(monkeypatch, capsys):
    import pagecli.serve.startup as server
    from pagecli.cli import main

    seen = []
    monkeypatch.setattr(server, "run_server", lambda settings, options: seen.append(options) or 0)
    assert main(["serve", "--reasoning-format", "none"]) == 0 and seen[-1].reasoning_format == "none"
    assert main(["serve"]) == 0 and seen[-1].reasoning_format == "separate"
    assert main(["serve", "--reasoning-format", "hidden"]) != 0 and len(seen) == 2
    err = capsys.readouterr().err
    assert "--reasoning-format must be none or separate (got 'hidden')" in err and "Traceback" not in err
