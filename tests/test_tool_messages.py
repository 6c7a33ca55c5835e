"""Conversations with tools: `tool` messages and assistant `tool_calls` accepted, and the tools given to
the chat template as transformers gives them (or described in the system message where the template
takes none)."""

from __future__ import annotations

import pytest

from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.errors import RequestError
from pagecli.models.loader import load_tokenizer
from pagecli.models.messages import Conversation, read_messages
from pagecli.models.tokenizer import PlainTokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]
# The tool parts of Qwen2.5's template, in short.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_messages_and_assistant_tool_calls_are_accepted_with_arguments_as_objects():
    messages = read_messages(CONVERSATION)
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == CONVERSATION[2]


@pytest.mark.parametrize("message, words", [
    ({"role": "assistant", "content": None, "tool_calls": "call"}, "'tool_calls' must be a list"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "on an assistant message"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "needs 'function' with a string 'name'"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "not valid JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "a JSON object"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, "'tool_call_id' must be a string"),
])
def test_malformed_tool_fields_are_refused_naming_the_message(message, words):
    with pytest.raises(RequestError, match="message 1"):
        read_messages([message])
    with pytest.raises(RequestError, match=words.replace("(", r"\(")):
        read_messages([message])


def test_tools_render_in_the_template_as_transformers_renders_them(tiny_llama):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    assert isinstance(ours, PlainTokenizer)
    ours.chat_template = theirs.chat_template = TOOLS_TEMPLATE
    messages = read_messages(CONVERSATION)
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=TOOLS)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=TOOLS)
    assert '"name": "get_weather"' in text and '"arguments": {"city": "Paris"}' in text
    assert "<tool_response>\n{\"temp_c\": 21}" in text


def test_the_engine_gives_the_template_the_conversations_tools(tiny_llama, tmp_path):
    with Engine(str(tiny_llama), EngineConfig(num_blocks=64, disk_cache=False)) as engine:
        engine.chat_template = engine.tokenizer.chat_template = TOOLS_TEMPLATE
        with_tools = engine.tokenizer.decode(engine.encode(Conversation(CONVERSATION, TOOLS)))
        without = engine.tokenizer.decode(engine.encode(Conversation(CONVERSATION, None)))
    assert "<tools>" in with_tools and "Weather in a city" in with_tools
    assert "<tools>" not in without and without == engine.tokenizer.decode(engine.encode(CONVERSATION))


def test_a_template_without_tools_gets_them_in_the_system_message(tiny_llama):
    with Engine(str(tiny_llama), EngineConfig(num_blocks=64, disk_cache=False)) as engine:
        assert "tools" not in (engine.chat_template or "")
        text = engine.tokenizer.decode(engine.encode(Conversation([{"role": "user", "content": "hi"}], TOOLS)))
    assert "Weather in a city" in text and "<tool_call>" in text

