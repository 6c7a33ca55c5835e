"""The first second of `pagecli serve`: the port taken and answering "loading" (pagecli/serve/loading.py)
before the engine's modules, torch among them, are imported (pagecli/serve/server.py, seconds)."""

from __future__ import annotations

from typing import Any

from pagecli.serve.loading import LoadingAnswers, listen_socket
from pagecli.serve.options import ServeOptions
from pagecli.ui.progress import say

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def run_server(settings: Any, options: ServeOptions) -> int:
    """Take the port, answer "loading" on it while the model loads, then serve (pagecli.serve.server)."""
    if options.host not in LOOPBACK_HOSTS and not options.api_key:
        say(f"Warning: listening on {options.host} without --api-key: anyone who can reach this machine can use "
            "the model.", style="yellow")
    sock = listen_socket(options.host, options.port)
    loading = LoadingAnswers(sock)
    loading.start()
    host, port = sock.getsockname()[:2]
    say(f"Loading model ... (http://{host}:{port}/health says \"loading\" until it is ready)", style="dim")
    try:
        from pagecli.serve.server import serve_model  # torch, the engine, uvicorn: seconds, while /health answers

        return serve_model(settings, options, sock, loading)
    finally:
        loading.stop()
        sock.close()
