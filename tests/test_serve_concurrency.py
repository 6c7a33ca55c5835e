"""Concurrent clients share one engine and one batch; a client that leaves cancels its request and
frees its blocks at once; a full queue answers 429 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from pagecli.config import SamplingParams
from pagecli.engine import Engine
from serve_helpers import engine_config, running_server, slow_steps, sse_payloads

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_32_concurrent_clients_get_generates_greedy_outputs_in_one_batch(tiny_llama):
    conversations = [[{"role": "user", "content": f"Question {i}: where does the fox jump{'?' * (i % 3)}"}]
                     for i in range(32)]
    with running_server(tiny_llama) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

        async def ask(messages, stream):
            if not stream:
                reply = await client.chat.completions.create(model=server.model_id, messages=messages,
                                                             max_tokens=8, temperature=0)
                return reply.choices[0].message.content
            parts = await client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=8,
                                                         temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in parts if c.choices])

        async def ask_all():
            try:
                return await asyncio.gather(*(ask(m, i % 2 == 0) for i, m in enumerate(conversations)))
            finally:
                await client.close()

        answers = asyncio.run(ask_all())
        stats = server.engine.stats()
        server.wait_idle()
    reference = Engine(str(tiny_llama), engine_config())
    expected = reference.generate(conversations, SamplingParams(temperature=0, max_tokens=8))
    assert answers == [c.text for c in expected]
    assert stats.num_steps < stats.tokens_generated / 2  # the requests shared steps: one batch


def _open_stream(http: httpx.Client, server, prompt: str):
    """Starts a streaming completion and reads its first chunk; returns the open response and its line
    iterator (dropping the iterator would close the response)."""
    request = http.build_request("POST", "/v1/completions", json={"model": server.model_id, "prompt": prompt,
                                                                  "stream": True})
    response = http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    first = json.loads(next(sse_payloads(lines)))
    assert first["choices"][0]["finish_reason"] is None
    return response, lines


def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_blocks(tiny_llama):
    with running_server(tiny_llama, sampling=LONG) as server, httpx.Client(base_url=server.base_url) as http:
        slow_steps(server)
        response, _ = _open_stream(http, server, "The quick brown fox jumps over the lazy dog again and again")
        assert server.engine.stats().blocks_active > 0 or server.state.engine_thread.pending == 1
        response.close()
        server.wait_idle(timeout_s=5)
        stats = server.engine.stats()
        assert stats.blocks_active == 0 and stats.num_running == 0
        line = server.log_lines[-1]
        assert " 499 " in line and "disconnected" in line
        assert int(line.split("completion ")[1].split()[0]) < 100


def test_a_client_leaving_before_a_whole_reply_cancels_it(tiny_llama):
    with running_server(tiny_llama, sampling=LONG) as server:
        slow_steps(server)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/v1/completions", timeout=0.3,
                       json={"model": server.model_id, "prompt": "Hello world"})
        server.wait_idle(timeout_s=5)
        assert server.engine.stats().blocks_active == 0
        assert " 499 " in server.log_lines[-1]


def test_a_full_queue_answers_429_with_retry_after(tiny_llama):
    with running_server(tiny_llama, sampling=LONG, max_pending=2) as server, \
            httpx.Client(base_url=server.base_url) as http:
        slow_steps(server)
        streams = [_open_stream(http, server, f"Story number {i}:") for i in range(2)]
        refused = http.post("/v1/completions", json={"model": server.model_id, "prompt": "One more"})
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0).completions.create(
                model=server.model_id, prompt="And another")
        for response, _ in streams:
            response.close()
        server.wait_idle(timeout_s=5)
        accepted = http.post("/v1/completions", json={"model": server.model_id, "prompt": "Now", "max_tokens": 2})
        assert accepted.status_code == 200
        time.sleep(0.05)
