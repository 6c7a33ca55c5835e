"""`pagecli serve` enforces `response_format`: json_schema and json_object replies parse and validate, streamed
or not; a schema that cannot be enforced is a 400 naming the problem; and the official client's
`beta.chat.completions.parse()` with a Pydantic model gets a parsed answer for every prompt."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from serve_helpers import checked_idle, client, running_server, server  # noqa: F401 - client, server: fixtures

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
         "required": ["ok", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def test_json_schema_reply_validates(server, client):
    reply = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=400,
                                           temperature=0, response_format=RESPONSE_FORMAT)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SMALL)


def test_streamed_json_schema_reply_equals_the_whole_one(server, client):
    whole = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=400,
                                           temperature=0, response_format=RESPONSE_FORMAT)
    chunks = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=400,
                                            temperature=0, response_format=RESPONSE_FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), SMALL)


def test_completions_endpoint_takes_response_format_too(server, client):
    reply = client.completions.create(model=server.model_id, prompt="JSON: ", max_tokens=400, temperature=0,
                                      extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(reply.choices[0].text), SMALL)


def test_json_object_reply_is_an_object(server, client):
    reply = client.chat.completions.create(model=server.model_id, messages=MESSAGES, max_tokens=400, temperature=0,
                                           response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # a random model may nest objects until max_tokens; what it wrote is a JSON object's start
        assert content.lstrip().startswith("{")


@pytest.mark.parametrize("response_format, says", [
    ({"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}},
     "'uniqueItems'"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nope"}}}, 'Unsupported type "nope"'),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "[a-"}}},
     "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "missing"}}, "has no 'schema'"),
    ({"type": "xml"}, "response_format.type must be"),
    ("json", "response_format must be an object"),
])
def test_a_bad_or_unenforceable_schema_is_a_400_naming_it(server, response_format, says):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        response = http.post("/v1/chat/completions", json={"model": server.model_id, "messages": MESSAGES,
                                                           "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error", error
    server.wait_idle()


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float
    is_capital: bool


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Delhi", "Cairo", "Quito", "Hanoi", "Rome",
          "Berlin", "Madrid", "Nairobi", "Seoul", "Sydney", "Toronto", "Dublin", "Vienna", "Prague", "Lisbon",
          "Athens", "Manila", "Bogota", "Havana", "Dakar", "Accra", "Ankara", "Bangkok", "Beirut", "Bern",
          "Brussels", "Budapest", "Buenos Aires", "Caracas", "Chicago", "Copenhagen", "Dhaka", "Doha", "Helsinki",
          "Istanbul", "Jakarta", "Kyiv", "London", "Mexico City", "Montreal", "Moscow", "Mumbai", "Santiago",
          "Stockholm", "Warsaw"]


@pytest.mark.slow
def test_openai_parse_with_a_pydantic_model_on_the_embedded_model(smollm2_dir):
    """50 prompts, sent 8 at a time (the engine batches them); every answer parses into City."""
    threads = torch.get_num_threads()
    with running_server(smollm2_dir, num_blocks=1024) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(city: str) -> City | None:
            reply = client.beta.chat.completions.parse(
                model=server.model_id, response_format=City, max_tokens=120, temperature=0,
                messages=[{"role": "user", "content": f"Describe the city of {city} as JSON."}])
            assert reply.choices[0].finish_reason == "stop", reply
            return reply.choices[0].message.parsed

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, CITIES))
        checked_idle(server)
    torch.set_num_threads(threads)
    assert all(isinstance(answer, City) for answer in answers), answers
    assert len({answer.name for answer in answers}) > 5  # answers about different cities, not one canned reply
