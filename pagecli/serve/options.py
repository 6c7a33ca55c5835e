"""What `pagecli serve` was asked for on its command line (pagecli/cli/serve.py fills it in)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_pending: int = 256  # candidates queued or running; more get 429
    grace_s: float = 30.0  # how long SIGTERM waits for running requests before cancelling them
    screen: bool | None = None  # the live pool panel and request table; default: when stdout is a terminal
    reasoning_format: str = "separate"  # separate: <think> text as reasoning_content; none: left in content
    keep_alive_s: float | None = None  # stop this long after the last request (and be found in the registry)
