"""Chat messages as OpenAI clients send them: content parts, the developer role, and every failure a
request can cause while it is templated or tokenized turned into a RequestError for that request."""

from __future__ import annotations

import pytest
from tiny_models import with_template_prefix

from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.errors import PagecliError, RequestError, request_failure
from pagecli.models.messages import developer_as_system, read_messages

PARTS = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]


def test_text_parts_are_joined_in_order():
    assert read_messages(PARTS) == [{"role": "user", "content": "Say\nhi"}]


def test_an_image_part_says_the_model_takes_text_only():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError, match="'image_url' part; this model takes text only"):
        read_messages(messages)


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "x"}], "message 1 needs a string 'role'"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
    ([{"role": "user", "content": [{"type": "text"}]}], "each content part needs"),
    ([{"role": "user", "content": None}], "must be a string or a list"),
])
def test_malformed_messages_are_refused_with_the_reason(messages, fragment):
    with pytest.raises(RequestError, match=fragment):
        read_messages(messages)


def test_an_assistant_message_may_have_no_content():
    assert read_messages([{"role": "assistant", "content": None}])[0]["content"] == ""


def test_developer_becomes_system_only_where_the_template_lacks_it():
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert developer_as_system(messages, "{{ messages }}")[0]["role"] == "system"
    assert developer_as_system(messages, "{% if m.role == 'developer' %}")[0]["role"] == "developer"


def test_request_failure_sorts_request_faults_from_bugs():
    import jinja2

    assert request_failure(PagecliError("bad")) == "bad"
    assert "System message must come first" in request_failure(jinja2.TemplateError("System message must come first"))
    assert request_failure(RecursionError("deep")) is not None
    assert request_failure(KeyError("bug")) is None


# --- through the engine -----------------------------------------------------------------------------


@pytest.fixture
def engine(tiny_llama):
    with Engine(str(tiny_llama), EngineConfig(num_blocks=64, disk_cache=False)) as engine:
        yield engine


def test_content_parts_and_developer_encode_as_their_plain_equivalents(engine):
    plain = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say\nhi"}]
    sent = [{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]}, *PARTS]
    assert engine.encode(sent) == engine.encode(plain)


def test_a_template_that_rejects_the_conversation_raises_a_request_error(tiny_llama, tmp_path):
    folder = with_template_prefix(tiny_llama, tmp_path / "strict")
    with Engine(str(folder), EngineConfig(num_blocks=64, disk_cache=False)) as engine:
        with pytest.raises(RequestError, match="System message must come first"):
            engine.add_request([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
        assert engine.add_request([{"role": "user", "content": "a"}])  # the engine goes on


@pytest.mark.parametrize("prompt", ["bad \ud800 surrogate", [10**9], [-1]])
def test_text_or_ids_the_tokenizer_cannot_take_raise_a_request_error(engine, prompt):
    with pytest.raises(RequestError):
        engine.add_request(prompt)
