"""`pagecli serve` answers on its port before the model is loaded (pagecli/serve/startup.py): /health says
"loading" with a 503, every other route a 503 in its API's error shape, until uvicorn takes the socket."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagecli.serve.loading import LoadingAnswers, listen_socket

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--attention", "torch", "--threads", "1"]


@pytest.fixture
def loading_port():
    sock = listen_socket("127.0.0.1", 0)
    answers = LoadingAnswers(sock)
    answers.start()
    try:
        yield sock.getsockname()[1], answers
    finally:
        answers.stop()
        sock.close()


def test_health_says_loading_with_a_503_and_a_retry_after(loading_port):
    port, _ = loading_port
    reply = httpx.get(f"http://127.0.0.1:{port}/health?verbose=1", timeout=5)
    assert reply.status_code == 503 and reply.json() == {"status": "loading"}
    assert reply.headers["retry-after"] == "1"
    head = httpx.head(f"http://127.0.0.1:{port}/health", timeout=5)
    assert head.status_code == 503 and head.content == b""


@pytest.mark.parametrize("path, shape", [
    ("/v1/chat/completions", lambda body: body["error"]["code"] == "model_loading"),
    ("/v1/messages", lambda body: body["type"] == "error" and body["error"]["type"] == "overloaded_error"),
    ("/api/chat", lambda body: isinstance(body["error"], str) and "loading" in body["error"]),
])
def test_a_request_while_loading_is_a_503_in_its_apis_shape(loading_port, path, shape):
    port, _ = loading_port
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}  # more than one read
    reply = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=5)
    assert reply.status_code == 503 and shape(reply.json())


def test_after_stop_a_connection_is_left_in_the_backlog_for_the_server(loading_port):
    port, answers = loading_port
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503
    answers.stop()
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        with pytest.raises(TimeoutError):
            client.recv(100)  # nobody answers: uvicorn would accept it
    assert answers.answered == 1


def test_serve_says_loading_before_the_model_is_ready_then_ok(tiny_llama):
    process = subprocess.Popen(
        [sys.executable, "-m", "pagecli", "serve", str(tiny_llama), "--port", "0", "--no-screen", *ENGINE_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"})
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        found = re.search(r"http://127\.0\.0\.1:(\d+)/health", line)
        assert found, line
        url = f"http://127.0.0.1:{found.group(1)}"
        statuses = []
        deadline = time.monotonic() + 120
        while not statuses or statuses[-1] != "ok":
            assert process.poll() is None and time.monotonic() < deadline, statuses
            reply = httpx.get(url + "/health", timeout=10)
            statuses.append(json.loads(reply.content)["status"])
            assert reply.status_code == (200 if statuses[-1] == "ok" else 503)
            time.sleep(0.01)
        assert statuses[0] == "loading"  # torch alone takes over a second to import
        assert httpx.post(url + "/v1/completions", json={"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 2},
                          timeout=30).status_code == 200
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in output, output


def test_a_client_that_sends_nothing_holds_up_the_answers_for_two_seconds_at_most(loading_port):
    port, _ = loading_port
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # connects, never sends
        time.sleep(0.1)
        start = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
        assert time.monotonic() - start < 4


def test_the_port_and_its_loading_answers_come_before_torch_starlette_and_uvicorn():
    # startup.py binds and answers before it imports serve/server.py: its own imports must stay light.
    probe = ("import sys, pagecli.serve.startup, pagecli.serve.loading; "
             "print(sorted({'torch', 'starlette', 'uvicorn', 'transformers'} & set(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
