"""Bad input on every endpoint the Responses, Messages and Ollama APIs add is a 4xx in that API's own error
shape, never a 500: wrong types, unknown tools, a schema that cannot be compiled, a missing
previous_response_id, an oversized body, a wrong or missing API key (Bearer or x-api-key)."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import API_KEY, checked_idle, running_server

BAD_SCHEMA = {"type": "string", "pattern": "[a-"}  # a regex that cannot be compiled
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, api_key=API_KEY) as running:
        yield running
        checked_idle(running)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def openai_error(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error["message"]


def anthropic_error(response: httpx.Response) -> str:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] != "api_error"
    return body["error"]["message"]


def ollama_error(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


SHAPES = {"/v1/responses": openai_error, "/v1/messages": anthropic_error,
          "/v1/messages/count_tokens": anthropic_error, "/api/chat": ollama_error, "/api/generate": ollama_error,
          "/api/show": ollama_error}

CASES = [
    # /v1/responses
    ("/v1/responses", {"input": 5}, "'input'"),
    ("/v1/responses", {"input": []}, "'input'"),
    ("/v1/responses", {"input": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text only"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": "ten"}, "'max_output_tokens'"),
    ("/v1/responses", {"input": "Hi", "temperature": "hot"}, "'temperature'"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "f"}],
                       "tool_choice": {"type": "function", "name": "g"}}, "'tool_choice'"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": BAD_SCHEMA}}},
     "cannot be compiled"),
    ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_gone"}, "resp_gone"),
    ("/v1/responses", {"input": "Hi", "previous_response_id": 7}, "previous_response_id"),
    ("/v1/responses", {"input": "Hi", "truncation": "auto"}, "truncation"),
    ("/v1/responses", {"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ("/v1/responses", {"input": "Hi", "model": "gpt-5"}, "gpt-5"),
    # /v1/messages
    ("/v1/messages", {"messages": USER}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 4, "messages": "Hi"}, "'messages'"),
    ("/v1/messages", {"max_tokens": "4", "messages": USER}, "'max_tokens'"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "robot", "content": "Hi"}]}, "role"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "bash_20250124"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}],
                      "tool_choice": {"type": "tool", "name": "g"}}, "'tool_choice'"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "stop_sequences": "END"}, "stop_sequences"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER,
                      "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}}, "cannot be compiled"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "model": "claude-opus-4"}, "claude-opus-4"),
    ("/v1/messages/count_tokens", {"messages": 3}, "'messages'"),
    ("/v1/messages/count_tokens", {"messages": USER, "tools": [{"type": "computer_20250124"}]}, "computer"),
    # Ollama
    ("/api/chat", {"messages": USER}, "'model'"),
    ("/api/chat", {"model": "MODEL", "messages": "Hi"}, "'messages'"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "options": {"num_ctx": 4096}}, "num_ctx"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "options": {"temperature": "warm"}}, "'temperature'"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "options": {"num_predict": 1.5}}, "'num_predict'"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "format": "yaml"}, "'format'"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "format": BAD_SCHEMA}, "cannot be compiled"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "tools": [{"type": "retrieval"}]}, "tools"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "think": "high"}, "think"),
    ("/api/chat", {"model": "MODEL", "messages": USER, "stream": "yes"}, "'stream'"),
    ("/api/chat", {"model": "other:7b", "messages": USER}, "other:7b"),
    ("/api/generate", {"model": "MODEL", "prompt": ["Hi"]}, "'prompt'"),
    ("/api/generate", {"model": "MODEL", "prompt": "Hi", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"model": "MODEL", "prompt": "Hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "MODEL", "prompt": "Hi", "raw": True, "system": "Be brief."}, "raw"),
    ("/api/show", {"model": "nothing-here"}, "nothing-here"),
    ("/api/show", {}, "'model'"),
]


@pytest.mark.parametrize("path, body, says", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_4xx_in_the_apis_own_shape(server, http, path, body, says):
    if path == "/v1/messages":
        body = {"model": "MODEL", **body}  # the Messages API requires one
    body = {key: server.model_id if value == "MODEL" else value for key, value in body.items()}
    for stream in (False, True):
        sent = {**body, "stream": stream} if "stream" not in body and path != "/api/show" else body
        response = http.post(path, json=sent)
        assert 400 <= response.status_code < 500, (response.status_code, response.text)
        assert says in SHAPES[path](response), response.text


@pytest.mark.parametrize("path", list(SHAPES))
def test_a_body_that_is_not_a_json_object_or_too_large_is_a_4xx_in_shape(server, http, path):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        SHAPES[path](response)
    huge = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    response = http.post(path, content=huge, headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert "larger than" in SHAPES[path](response)


def test_an_unknown_route_under_each_api_answers_in_its_shape(server, http):
    assert "/api/pull" in ollama_error(http.post("/api/pull", json={"model": "x"}))
    assert http.get("/v1/messages").status_code == 405
    anthropic_error(http.get("/v1/messages"))


def test_the_api_key_goes_as_bearer_or_x_api_key_and_a_wrong_one_is_a_401_in_shape(server):
    body = {"model": server.model_id, "max_tokens": 2, "messages": USER}
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        assert anonymous.post("/v1/messages", json=body, headers={"x-api-key": API_KEY}).status_code == 200
        assert anonymous.post("/v1/messages", json=body,
                              headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        wrong = anonymous.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
        assert wrong.status_code == 401 and anthropic_error(wrong) == "Incorrect API key."
        assert wrong.json()["error"]["type"] == "authentication_error"
        missing = anonymous.post("/api/chat", json={"model": server.model_id, "messages": USER, "stream": False})
        assert missing.status_code == 401 and "API key" in ollama_error(missing)
        for path in ("/v1/responses", "/v1/pool", "/api/tags", "/api/ps"):
            response = anonymous.request("POST" if path == "/v1/responses" else "GET", path, json={"input": "Hi"})
            assert response.status_code == 401, path
        assert anonymous.get("/").status_code == 200  # the page itself holds no data; it asks for the key


def test_no_bad_request_logged_a_traceback_or_a_500(server):
    assert not any(" 500 " in line for line in server.log_lines), [l for l in server.log_lines if " 500 " in l]
