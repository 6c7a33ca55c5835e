"""One request never hurts another: 32 streaming requests run while 32 hostile ones arrive (schemas that loop
or that the grammar engine cannot enforce, huge and NaN sampling values, templates through the request,
oversized bodies, wrong types); every hostile one gets a 4xx in OpenAI's error shape, and every good one
the greedy output it gets alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from pagecli.config import SamplingParams
from pagecli.engine import Engine
from serve_helpers import engine_config, running_server, slow_steps

MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


HI = [{"role": "user", "content": "Hi"}]
# Each hostile request: a chat completion body (a dict), or raw bytes sent as the body.
HOSTILE: list[dict | bytes] = [
    {"messages": HI, "response_format": schema_format({"$ref": "#"})},
    {"messages": HI, "response_format": schema_format({"$defs": {"a": {"$ref": "#/$defs/b"},
                                                                 "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
    {"messages": HI, "response_format": schema_format({"type": "string", "pattern": "a+", "minLength": 3})},
    {"messages": HI, "response_format": schema_format({"type": "string", "pattern": "(?=a)b"})},
    {"messages": HI, "response_format": schema_format({"not": {"type": "string"}})},
    {"messages": HI, "response_format": schema_format({"type": "string", "maxLength": 10 ** 9})},
    {"messages": HI, "response_format": schema_format({"type": "nonsense"})},
    {"messages": HI, "response_format": {"type": "json_schema", "json_schema": "not an object"}},
    {"messages": HI, "top_p": float("nan")},
    {"messages": HI, "top_k": -(10 ** 30)},
    {"messages": HI, "length_penalty": 1e308},
    {"messages": HI, "presence_penalty": float("inf")},
    {"messages": HI, "logit_bias": {"999999999": 5}},
    {"messages": HI, "logit_bias": {"1": 1e308}},
    {"messages": HI, "seed": 2 ** 80},
    {"messages": HI, "n": -1},
    {"messages": HI, "stop": 5},
    {"messages": HI, "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                      "{% endfor %}"},
    {"messages": HI, "chat_template_kwargs": {"enable_thinking": "{{ 'x' * 10 ** 12 }}"}},
    {"messages": "not a list"},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": HI, "max_tokens": "ten"},
    {"messages": HI, "stream": "yes"},
    {"messages": []},
    b"{not json",
    b"[1, 2, 3]",
    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": "' + b"x" * (17 << 20) + b'"}]}',
]
# Extreme but valid: each runs for itself (or is refused), and never disturbs the others.
EXTREME: list[dict | bytes] = [
    {"messages": HI, "temperature": 1e308},
    {"messages": HI, "max_tokens": 10 ** 30},
    {"messages": [{"role": "wizard", "content": "Hi"}]},
    {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
     "tool_choice": "required"},  # '#' is the whole calls schema here: recursion with an end
]


def test_32_streaming_requests_run_on_unchanged_while_32_hostile_requests_are_refused(tiny_llama):
    assert len(HOSTILE) + len(EXTREME) == 32
    prompts = [[{"role": "user", "content": f"Question {i}: where does the fox jump{'?' * (i % 3)}"}]
               for i in range(32)]
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with running_server(tiny_llama, sampling=sampling) as server:
        slow_steps(server, step_s=0.02)  # the good requests are still streaming when the hostile ones arrive

        async def good(http: httpx.AsyncClient, messages: list) -> str:
            body = {"model": server.model_id, "messages": messages, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                text = []
                async for line in response.aiter_lines():
                    payload = line.removeprefix("data: ")
                    if line.startswith("data: ") and payload != "[DONE]":
                        chunk = json.loads(payload)
                        assert "error" not in chunk, chunk
                        text += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
                return "".join(text)

        async def hostile(http: httpx.AsyncClient, request: dict | bytes) -> tuple[int, dict]:
            await asyncio.sleep(0.05)
            content = request if isinstance(request, bytes) else json.dumps(
                {"model": server.model_id, **request}, allow_nan=True).encode()
            response = await http.post("/v1/chat/completions", content=content,
                                       headers={"content-type": "application/json"})
            return response.status_code, response.json()

        async def everything():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
                return await asyncio.gather(asyncio.gather(*(good(http, p) for p in prompts)),
                                            asyncio.gather(*(hostile(http, r) for r in HOSTILE + EXTREME)))

        answers, refusals = asyncio.run(everything())
        server.wait_idle()
    refused = [400 <= status < 500 and isinstance(body["error"]["message"], str) for status, body in refusals]
    wrong = [f"{status} for {request[:60] if isinstance(request, bytes) else json.dumps(request)[:160]}: "
             f"{str(body)[:200]}" for request, (status, body), ok in zip(HOSTILE + EXTREME, refusals, refused)
             if not (ok or (request in EXTREME and status == 200))]
    assert not wrong, "\n".join(wrong)
    with Engine(str(tiny_llama), engine_config()) as reference:
        alone = [reference.generate([prompt], sampling)[0].text for prompt in prompts]
    assert answers == alone
