"""GET /v1/pool: the engine's stats snapshot, a letter per block, the requests in the engine and the last
turns, live while a request generates; a client rebuilds the very EngineStats the terminal panel draws."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from rich.console import Console

from pagecli.config import SamplingParams
from pagecli.serve.pool_view import STATE_LETTERS, engine_stats_of
from pagecli.ui.pool_panel import pool_panel
from serve_helpers import API_KEY, checked_idle, running_server, slow_steps


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, api_key=API_KEY,
                        sampling=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) as running:
        slow_steps(running, step_s=0.02)
        yield running
        checked_idle(running)


def pool(server) -> dict:
    response = httpx.get(server.base_url + "/v1/pool", headers={"x-api-key": API_KEY})
    assert response.status_code == 200, response.text
    return response.json()


def poll_until(server, ready, timeout_s=10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = pool(server)
        if ready(state):
            return state
        time.sleep(0.02)
    raise AssertionError(f"the pool state never got there: {state}")


def render(stats) -> str:
    console = Console(record=True, width=100, color_system=None)
    console.print(pool_panel(stats))
    return console.export_text()


def test_the_pool_state_follows_a_request_while_it_generates_and_lists_it_as_a_turn_after(server):
    idle = pool(server)
    assert idle["object"] == "pagecli.pool" and idle["model"] == server.model_id
    assert idle["stats"]["num_blocks"] == server.engine.config.num_blocks and idle["requests"] == []
    mapped = poll_until(server, lambda s: s["block_map"] is not None)  # asked for once: the map comes along
    assert len(mapped["block_map"]) == mapped["stats"]["num_blocks"]
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "Hello there! " * 10}]}
    done = threading.Event()
    threading.Thread(target=lambda: (httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60,
                                                headers={"Authorization": f"Bearer {API_KEY}"}), done.set()),
                     daemon=True).start()
    busy = poll_until(server, lambda s: s["requests"] and s["requests"][0]["completion_tokens"] > 0
                      and s["stats"]["blocks_active"] > 0 and "a" in (s["block_map"] or ""))
    running = busy["requests"][0]
    assert running["kind"] == "chat" and running["status"] == "running"
    assert running["prefilled_tokens"] == running["prompt_tokens"] - running["cached_tokens"]
    counts = {state: busy["block_map"].count(letter) for state, letter in STATE_LETTERS.items()}
    stats = busy["stats"]
    assert counts["free"] == stats["blocks_free"] and counts["cached"] == stats["blocks_cached"]
    assert counts["active"] + counts["shared"] == stats["blocks_active"]
    assert done.wait(30)
    after = poll_until(server, lambda s: not s["requests"] and s["turns"])
    turn = after["turns"][0]
    assert turn["completion_tokens"] == 30 and turn["status"] == "done"
    assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"] > 0
    assert after["stats"]["tokens_that_fit"] == (after["stats"]["blocks_free"] + after["stats"]["blocks_cached"]) * 16


def test_a_client_draws_the_terminal_panel_from_the_pool_state(server):
    state = poll_until(server, lambda s: s["block_map"] is not None)
    rebuilt = engine_stats_of(state)
    assert rebuilt.block_states is not None and len(rebuilt.block_states) == rebuilt.num_blocks
    server.wait_idle()
    time.sleep(0.3)  # the engine thread's snapshot settles
    state = pool(server)
    own = server.state.engine_thread.snapshot
    assert render(engine_stats_of(state)) == render(own)
    assert "KV block pool" in render(own)


def test_the_pool_state_needs_the_api_key(server):
    assert httpx.get(server.base_url + "/v1/pool").status_code == 401
