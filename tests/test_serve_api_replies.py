"""How each API's translation writes a reply that thinks, says something and calls a tool: a scripted engine
says exactly what the model "said", and each official client reads the reply back, streamed and not, as that
API's own items (Responses: reasoning, message, function_call; Anthropic: thinking, text, tool_use; Ollama:
thinking, content, tool_calls)."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
from scripted_engine import ScriptedEngine, scripted_server

REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def base_url():
    with scripted_server(ScriptedEngine([REPLY])) as url:
        yield url


def test_responses_api_writes_reasoning_a_message_and_a_function_call(base_url):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    response = client.responses.create(model="scripted", input=ASK, tools=tools)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "The user wants the weather."
    assert response.output_text == "Let me check."
    call = response.output[2]
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}' and call.call_id
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="scripted", input=ASK, tools=tools, stream=True))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == response.output_text and final.output[2].arguments == call.arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user wants the weather."


def test_anthropic_api_writes_thinking_text_and_tool_use_blocks(base_url):
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": PARAMETERS}]
    message = client.messages.create(model="scripted", max_tokens=200, messages=ASK, tools=tools)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "The user wants the weather." and message.content[1].text == "Let me check."
    assert message.content[2].name == "get_weather" and message.content[2].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    with client.messages.stream(model="scripted", max_tokens=200, messages=ASK, tools=tools) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_ollama_api_writes_thinking_content_and_tool_calls(base_url):
    client = ollama.Client(host=base_url)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    reply = client.chat(model="scripted", messages=ASK, tools=tools)
    assert reply.message.thinking == "The user wants the weather." and reply.message.content == "Let me check."
    assert reply.message.tool_calls[0].function.name == "get_weather"
    assert reply.message.tool_calls[0].function.arguments == {"city": "Paris"}
    parts = list(client.chat(model="scripted", messages=ASK, tools=tools, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    assert "".join(p.message.content for p in parts) == reply.message.content
    calls = [call for p in parts for call in p.message.tool_calls or ()]
    assert [c.function.arguments for c in calls] == [{"city": "Paris"}]
    unsplit = client.chat(model="scripted", messages=ASK, tools=tools, think=False)
    assert unsplit.message.thinking is None and "<think>" in unsplit.message.content
