"""Every mistake a client can make gets OpenAI's error shape with the right status and code, and no
traceback reaches the client or the server's console."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
import torch

from serve_helpers import API_KEY, checked_idle, running_server


@pytest.fixture(scope="module")
def server(tiny_llama):
    threads = torch.get_num_threads()
    with running_server(tiny_llama, api_key=API_KEY, max_model_len=64) as running:
        yield running
        checked_idle(running)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def chat_body(server, **fields):
    return {"model": server.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    assert "Traceback" not in response.text
    return body["error"]


@pytest.mark.parametrize("raw, what", [(b"{bad json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                       (b"\xff\xfe", "not valid JSON"), (b"", "not valid JSON")])
def test_a_body_that_is_not_a_json_object_is_a_400(server, http, raw, what):
    error = error_of(http.post("/v1/chat/completions", content=raw), 400)
    assert what in error["message"] and error["code"] == "invalid_json"


@pytest.mark.parametrize("fields, says", [
    ({"temperature": -1}, "temperature must be 0 or more"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_k": "ten"}, "'top_k' must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_completion_tokens": 2.5}, "'max_tokens' must be an integer"),
    ({"stop": [""]}, "'stop' must be a string or a list of non-empty strings"),
    ({"seed": True}, "'seed' must be an integer"),
    ({"n": 0}, "'n' must be an integer from 1 to"),
    ({"stream": "yes"}, "'stream' must be true or false"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "takes text only"),
])
def test_bad_fields_are_a_400_naming_the_field(server, http, fields, says):
    error = error_of(http.post("/v1/chat/completions", json=chat_body(server, **fields)), 400)
    assert says in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("echo", True), ("logprobs", True),
                                          ("suffix", "x"), ("beam_width", 4)])
def test_a_field_the_server_cannot_honour_is_refused_not_ignored(server, http, field, value):
    error = error_of(http.post("/v1/chat/completions", json=chat_body(server, **{field: value})), 400)
    assert error["code"] == "unsupported_parameter" and f"'{field}'" in error["message"]


def test_penalties_and_logit_bias_are_honoured_and_checked(server, http):
    body = chat_body(server, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": 1.0})
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    error = error_of(http.post("/v1/chat/completions", json=chat_body(server, logit_bias={"10000000": 1.0})), 400)
    assert "vocabulary" in error["message"]
    error = error_of(http.post("/v1/chat/completions", json=chat_body(server, presence_penalty=3)), 400)
    assert "presence_penalty" in error["message"]


def test_harmless_and_unknown_fields_are_ignored(server, http):
    body = chat_body(server, user="me", metadata={"a": "b"}, tool_choice="none", logprobs=False, whatever=1)
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_a_prompt_over_the_context_is_context_length_exceeded(server, http):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 40
    error = error_of(http.post("/v1/completions", json={"model": server.model_id, "prompt": long_prompt}), 400)
    assert error["code"] == "context_length_exceeded" and "at most 64 tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": long_prompt}], stream=True)
    assert caught.value.code == "context_length_exceeded"


def test_a_wrong_model_name_is_a_404(server, http):
    error = error_of(http.post("/v1/chat/completions", json=chat_body(server, model="gpt-4o")), 404)
    assert error["code"] == "model_not_found" and server.model_id in error["message"]


def test_a_missing_or_wrong_api_key_is_a_401(server):
    assert error_of(httpx.get(server.base_url + "/v1/models"), 401)["code"] == "missing_api_key"
    wrong = httpx.post(server.base_url + "/v1/chat/completions", json=chat_body(server),
                       headers={"Authorization": "Bearer sk-wrong"})
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key


def test_unknown_routes_and_methods_answer_in_the_same_shape(server, http):
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "not_found"
    error_of(http.get("/v1/chat/completions"), 405)


def test_no_client_mistake_logs_a_traceback(server, http, caplog, capfd):
    with caplog.at_level(logging.DEBUG):
        http.post("/v1/chat/completions", content=b"{")
        http.post("/v1/chat/completions", json=chat_body(server, temperature="hot"))
        http.post("/v1/completions", json={"model": server.model_id, "prompt": [10**9]})
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err + caplog.text
    assert any("400" in line and "vocabulary" in line for line in server.log_lines)
