"""`pagecli serve --keep-alive DURATION`: how long the server has gone without a request, so it can stop
DURATION after its last one (Ollama's keep_alive, for the whole server).

IdleClock wraps the app (ASGI middleware): a request is in flight from its arrival to the last byte of its
answer (a streamed reply included), and the server is idle only while none is. The clock starts when the
server is ready, so a server nobody uses stops DURATION after it started. /health and /metrics do not
count: a probe (the registry's liveness check, a monitor) is not a client. Everything here runs on the
server's event loop thread, which is why plain counters suffice.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pagecli.errors import PagecliError

NOT_CLIENTS = ("/health", "/metrics")

Asgi = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class IdleClock:
    """ASGI middleware counting requests in flight and the time since the last one ended."""

    def __init__(self, app: Asgi, keep_alive_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.keep_alive_s = keep_alive_s
        self.clock = clock
        self.in_flight = 0
        self.last_end_s = clock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") in NOT_CLIENTS:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.last_end_s = self.clock()

    def restart(self) -> None:
        """Count from now (the server has just become ready)."""
        self.last_end_s = self.clock()

    def idle_s(self) -> float:
        return 0.0 if self.in_flight else self.clock() - self.last_end_s

    def expired(self) -> bool:
        return self.in_flight == 0 and self.idle_s() >= self.keep_alive_s


def describe(seconds: float) -> str:
    """A duration as the user would write it: 0s, 30s, 5m, 1h30m, 2.5s."""
    if seconds != int(seconds) or seconds < 60:
        return f"{seconds:g}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{value}{unit}" for value, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if value)


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def parse_duration(text: str) -> float:
    """Seconds of a DURATION: a number of seconds ("90", "0"), or numbers with units h, m, s, ms ("30s",
    "5m", "1h30m", "1.5s"). PagecliError for anything else, a negative value included."""
    spelled = text.strip().lower()
    try:
        seconds = float(spelled)
    except ValueError:
        parts = _PART.findall(spelled)
        if not spelled or "".join(number + unit for number, unit in parts) != spelled:
            raise PagecliError(f"--keep-alive takes a duration such as 30s, 5m, 1h30m or 0 (got '{text}').") from None
        seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if not math.isfinite(seconds) or seconds < 0:
        raise PagecliError(f"--keep-alive takes a duration of 0 or more (got '{text}'); leave it out to serve until "
                           "stopped.")
    return seconds
