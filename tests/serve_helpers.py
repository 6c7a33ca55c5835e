"""A real `pagecli serve` stack (engine thread, Starlette app, uvicorn) on a free port in a thread, for
the serve tests; and small HTTP helpers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import torch
import uvicorn

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
from pagecli.serve.app import ServeState, create_app
from pagecli.serve.request_log import RequestLog
from pagecli.serve.server import ServeOptions, build_state, load_on_engine_thread
from pagecli.serve.loading import listen_socket

API_KEY = "sk-test-key"


def engine_config(**overrides: Any) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", attention="torch", num_blocks=96, threads=1, disk_cache=False)
    return EngineConfig(**{**base, **overrides})


@dataclass
class Settings:
    """The slice of RunSettings the server reads."""

    model: str
    sampling: SamplingParams


@dataclass
class RunningServer:
    base_url: str
    state: ServeState
    engine: Engine
    log_lines: list[str]

    @property
    def model_id(self) -> str:
        return self.state.model_ids[0]

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until every request has left the engine thread (cancellations are asynchronous)."""
        deadline = time.monotonic() + timeout_s
        while self.state.engine_thread.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.state.engine_thread.pending == 0, "requests still pending in the engine thread"


@contextmanager
def running_server(model_dir: Any, api_key: str | None = None, max_pending: int = 256,
                   sampling: SamplingParams | None = None, **engine_overrides: Any) -> Iterator[RunningServer]:
    # As `pagecli serve` does: built on the thread that will step it.
    home, engine = load_on_engine_thread(lambda: Engine(str(model_dir), engine_config(**engine_overrides)))
    lines: list[str] = []
    settings = Settings(str(model_dir), sampling or SamplingParams(temperature=0, max_tokens=8))
    options = ServeOptions(port=0, api_key=api_key, max_pending=max_pending, grace_s=2)
    state = build_state(engine, settings, options, RequestLog(sink=lines.append), home=home)
    try:
        with serving(state, grace_s=2) as base_url:
            yield RunningServer(base_url, state, engine, lines)
    finally:
        engine.close()


@contextmanager
def serving(state: ServeState, grace_s: float) -> Iterator[str]:
    """The app of `state` served by uvicorn on a free port in a thread, its engine thread running; yields
    the base URL, and stops both."""
    sock = listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    state.engine_thread.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        state.engine_thread.stop(grace_s=grace_s)
        sock.close()


def checked_idle(server: RunningServer) -> None:
    """The server's engine is idle, every block back in the pool (for module-scoped servers, which the
    per-test pool check does not see)."""
    from pool_checks import check_engine_pool

    server.wait_idle()
    time.sleep(0.05)  # the engine thread publishes its last step's events before it idles
    check_engine_pool(server.engine)
    assert server.engine.stats().blocks_active == 0


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event, '[DONE]' included."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


def slow_steps(server, step_s: float = 0.01) -> None:
    """Each engine step takes at least step_s, so a LONG request runs for seconds (a tiny model is fast)."""
    step = server.engine.step

    def slow_step():
        time.sleep(step_s)
        return step()

    server.engine.step = slow_step


@pytest.fixture(scope="module")
def server(tiny_llama):
    """One server on the tiny model for a whole test module (import it with `client`)."""
    threads = torch.get_num_threads()
    with running_server(tiny_llama) as running:
        yield running
        checked_idle(running)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


ROOMY_CONTEXT = dict(max_position_embeddings=4096)  # tool prompts and a random model's whitespace-rich JSON fit
ROOMY_BLOCKS = 320


@contextmanager
def roomy_server(tiny_model_factory, **options: Any) -> Iterator[RunningServer]:
    """A server on a tiny llama with a 4,096-token context (the default tiny model has 512)."""
    threads = torch.get_num_threads()
    model = tiny_model_factory("llama", **ROOMY_CONTEXT)
    with running_server(model, num_blocks=ROOMY_BLOCKS, **options) as running:
        yield running
        checked_idle(running)
    torch.set_num_threads(threads)
