"""The `pagecli serve` process: SIGTERM lets in-flight requests finish, flushes the disk prefix store and
exits 0; a taken port is one clear sentence; listening beyond loopback without a key warns."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai

from pagecli.cli import main
from pagecli.config import SamplingParams
from serve_helpers import running_server, slow_steps, sse_payloads

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention", "torch", "--threads", "1"]


def _start_server(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, int, list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "pagecli", "serve", str(model_dir), "--port", "0", "--no-screen", *ENGINE_FLAGS,
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    lines: list[str] = []
    for line in process.stdout:  # type: ignore[union-attr]
        lines.append(line)
        match = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
        if match:
            return process, int(match.group(1)), lines
    raise AssertionError("the server never said where it listens:\n" + "".join(lines))


def test_sigterm_finishes_in_flight_requests_flushes_the_store_and_exits_0(tiny_model_factory, isolated_home):
    long_context = tiny_model_factory("llama", max_position_embeddings=4096)  # 4,000 tokens: seconds of work
    process, port, lines = _start_server(long_context, "--grace", "30", "--ignore-eos", "--cache-prefix",
                                         "--num-blocks", "300")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    first_chunk, replies = threading.Event(), []

    def ask() -> None:
        chunks = client.completions.create(model=str(long_context), prompt="The quick brown fox jumps over the "
                                           "lazy dog, and the dog sleeps on.", max_tokens=4000, stream=True,
                                           temperature=0)
        parts = []
        for chunk in chunks:
            first_chunk.set()
            parts.append(chunk.choices[0])
        replies.append(parts)

    asker = threading.Thread(target=ask)
    asker.start()
    assert first_chunk.wait(30)
    process.send_signal(signal.SIGTERM)
    asker.join(30)
    output, _ = process.communicate(timeout=30)
    log = "".join(lines) + output
    assert process.returncode == 0, log
    assert "1 sequence(s) still running" in log, log  # SIGTERM came while the request ran
    assert replies and replies[0][-1].finish_reason == "length", log  # and it finished, not cut off
    assert "Stopped." in log and "Traceback" not in log
    blobs = list(Path(isolated_home).rglob("*.safetensors"))
    assert any("prefix" in str(blob) for blob in blobs), f"no prefix blocks on disk under {isolated_home}"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_requests_still_running_after_the_grace_period_are_cancelled_with_an_error(tiny_llama):
    sampling = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with running_server(tiny_llama, sampling=sampling) as server, httpx.Client(base_url=server.base_url) as http:
        slow_steps(server)
        with http.stream("POST", "/v1/chat/completions", json={
                "model": server.model_id, "messages": [{"role": "user", "content": "Go on"}], "stream": True}) as reply:
            events = sse_payloads(reply.iter_lines())
            assert json.loads(next(events))["choices"]
            server.state.engine_thread.stop(grace_s=0.1)
            rest = [json.loads(e) for e in events if e != "[DONE]"]
        assert rest[-1]["error"]["code"] == "server_shutting_down"
        assert server.engine.stats().blocks_active == 0 and not server.engine.has_unfinished
        refused = http.post("/v1/completions", json={"model": server.model_id, "prompt": "Hi"})
        assert refused.status_code == 503 and http.get("/health").status_code == 503


def test_a_client_that_connects_as_soon_as_the_port_is_said_is_not_refused():
    # The server says where it listens before uvicorn starts serving: the socket must already
    # listen, so that such a client waits in the backlog (it was refused: CI saw it once).
    from pagecli.serve.loading import listen_socket

    with listen_socket("127.0.0.1", 0) as sock, socket.create_connection(sock.getsockname()[:2], timeout=5):
        accepted, _ = sock.accept()
        accepted.close()


def test_a_taken_port_is_one_sentence_and_a_public_host_without_a_key_warns(tiny_llama, capsys):
    with socket.socket() as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        code = main(["serve", str(tiny_llama), "--host", "0.0.0.0", "--port", str(port), "--no-screen"])
    err = capsys.readouterr().err
    assert code == 2
    assert "without --api-key" in err
    assert f"Cannot listen on 0.0.0.0:{port}" in err and "Traceback" not in err


def test_an_engine_step_that_raises_fails_the_running_requests_and_the_server_goes_on(tiny_llama, caplog):
    with running_server(tiny_llama) as server, httpx.Client(base_url=server.base_url) as http:
        step = server.engine.step

        def broken_step():
            server.engine.step = step  # fails once, before touching the engine
            raise RuntimeError("a bug in the engine")

        server.engine.step = broken_step
        failed = http.post("/v1/completions", json={"model": server.model_id, "prompt": "Hello"})
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "server_error"
        assert "a bug in the engine" not in failed.text  # the traceback goes to the server's log only
        assert "a bug in the engine" in caplog.text
        again = http.post("/v1/completions", json={"model": server.model_id, "prompt": "Hello"})
        assert again.status_code == 200
        server.wait_idle()


def test_a_system_prompt_served_by_one_server_is_a_disk_hit_for_the_next(tiny_llama):
    system = {"role": "system", "content": "You answer questions about the lazy dog and the fox. " * 3}

    def ask(server, question: str) -> int:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=server.model_id, max_tokens=2, temperature=0,
                                               messages=[system, {"role": "user", "content": question}])
        return reply.usage.prompt_tokens_details.cached_tokens

    with running_server(tiny_llama, disk_cache=True) as yesterday:
        ask(yesterday, "Who sleeps?")
        ask(yesterday, "Who jumps?")  # shared by two requests: written to the disk store
    with running_server(tiny_llama, disk_cache=True) as today:
        cached = ask(today, "Who runs?")
        assert cached >= 2 * today.engine.config.block_size
        assert today.engine.stats().prefix_disk_hit_tokens == cached


def test_serve_refuses_a_command_line_n_since_n_is_per_request(tiny_llama, capsys):
    assert main(["serve", str(tiny_llama), "--n", "2", "--port", "0", "--no-screen"]) == 2
    assert "takes n per request" in capsys.readouterr().err


def test_the_engine_is_built_and_stepped_on_one_thread(tiny_llama, monkeypatch):
    """libgomp gives each thread that opens a parallel region its own OpenMP team; with two teams on a
    machine of few cores every barrier sleeps (35,000 context switches in a 64-request run, steps 15-20%
    slower). So the server builds its engine on the thread that steps it, not on the main thread."""
    from pagecli.engine import Engine

    threads: dict[str, set[int]] = {"built": set(), "stepped": set()}
    real_init, real_step = Engine.__init__, Engine.step

    def recording_init(self, *args, **kwargs):
        threads["built"].add(threading.get_ident())
        real_init(self, *args, **kwargs)

    def recording_step(self):
        threads["stepped"].add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    monkeypatch.setattr(Engine, "step", recording_step)
    with running_server(tiny_llama) as server:
        reply = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x").completions.create(
            model=server.model_id, prompt="The fox", max_tokens=3)
    assert reply.choices[0].text
    assert len(threads["built"]) == 1 and threads["stepped"] == threads["built"]
    assert threading.get_ident() not in threads["built"]
