"""The port of `pagecli serve`, taken and answering before torch is imported or the model loaded. Until the
model is ready, a thread answers every request on the listening socket with 503: /health with
`{"status": "loading"}`, anything else with a `model_loading` error in its API's shape and `Retry-After`. Then
uvicorn takes the same socket (pagecli/serve/server.py). No torch, starlette or uvicorn here: it runs first.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from typing import Any

from pagecli.errors import PagecliError

LISTEN_BACKLOG = 2048  # uvicorn's default backlog
LOADING_MESSAGE = "The model is still loading; retry in a moment."
RETRY_AFTER_S = 1
_HEAD_LIMIT = 64 * 1024  # a request head longer than this is answered without reading the rest
_BODY_LIMIT = 8 * 1024 * 1024  # the server's body limit: a larger body is not read, the connection closes
_IO_TIMEOUT_S = 2.0  # the most one connection may take (a slow client holds up the others, and the start, no longer)


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is one clear sentence (uvicorn would exit), and
    listening from here on: a client that connects as soon as the server says where it listens waits
    in the backlog until it is answered, instead of being refused in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise PagecliError(f"Cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port or "
                           "--host.") from None
    sock.set_inheritable(True)
    return sock


class LoadingAnswers:
    """A thread that answers each connection on `sock` with one 503 (loading_reply) until stop(). stop()
    returns once the thread no longer accepts: a connection after it waits in the backlog for uvicorn."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.answered = 0  # connections answered so far (tests)
        self._stop = threading.Event()
        self._wake, self._waker = socket.socketpair()  # stop() writes one byte: the thread waits on nothing else
        self._thread = threading.Thread(target=self._run, name="pagecli-loading-answers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._waker.send(b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._wake.close()
        self._waker.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock, self._wake], [], [])
            except (OSError, ValueError):
                return  # a socket was closed
            if self._stop.is_set() or self.sock not in ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                self._answer(conn)
            self.answered += 1

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        deadline = time.monotonic() + _IO_TIMEOUT_S
        try:
            head, body_read = _read_head(conn, deadline)
            method, path, length = _request_line(head)
            if length is not None and length <= _BODY_LIMIT:
                _drain(conn, length - body_read, deadline)  # unread bytes could make the close a reset
            conn.sendall(loading_reply(method, path))
        except OSError:
            pass  # the client left or stalled: nothing to answer


def loading_reply(method: str, path: str) -> bytes:
    """The whole HTTP/1.1 response to a request while the model loads."""
    if path == "/health":
        body: Any = {"status": "loading"}
    elif path.startswith("/api/"):
        body = {"error": LOADING_MESSAGE}  # Ollama's shape
    elif path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "overloaded_error", "message": LOADING_MESSAGE}}  # Anthropic's
    else:
        body = {"error": {"message": LOADING_MESSAGE, "type": "server_error", "param": None, "code": "model_loading"}}
    data = json.dumps(body).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("latin-1") + (b"" if method == "HEAD" else data)


def _recv(conn: socket.socket, size: int, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    conn.settimeout(left)
    return conn.recv(size)


def _read_head(conn: socket.socket, deadline: float) -> tuple[bytes, int]:
    """The request's head, and how many bytes of its body came with it."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < _HEAD_LIMIT:
        chunk = _recv(conn, 65536, deadline)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, len(rest)


def _request_line(head: bytes) -> tuple[str, str, int | None]:
    """Method, path (no query) and Content-Length (None when absent or not a number) of a request head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("GET", "/")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip()) if value.strip().isdigit() else None
    return method.upper(), target.split("?", 1)[0], length


def _drain(conn: socket.socket, remaining: int, deadline: float) -> None:
    while remaining > 0:
        chunk = _recv(conn, min(remaining, 65536), deadline)
        if not chunk:
            return
        remaining -= len(chunk)
