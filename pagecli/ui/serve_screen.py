"""The server's terminal screen: the block-pool panel that `chat` shows, a live table of the requests in
the engine (status, prompt and cached tokens, tokens so far, TTFT, tokens/s) and the latest log lines.

It draws what the engine thread publishes (its stats snapshot and a copy of its jobs) and computes
nothing about the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagecli.ui.pool_panel import pool_panel

_LOG_LINES = 8
_TABLE_ROWS = 16
_REFRESHES_PER_S = 4


def requests_table(jobs: Sequence[Any], now_s: float) -> Table:
    """One row per request in the engine, oldest first; the rows past the screen's room are counted."""
    table = Table(title=f"requests in the engine: {len(jobs)}", title_justify="left", expand=False)
    for column in ("#", "kind", "n", "status", "prompt", "cached", "tokens", "TTFT", "tok/s"):
        table.add_column(column, justify="left" if column in ("kind", "status") else "right")
    for job in jobs[:_TABLE_ROWS]:
        rate = job.tokens_per_s(now_s)
        table.add_row(str(job.number), job.kind, str(job.n), job.status if job.first_token_s else "prefill",
                      str(job.prompt_tokens), str(job.cached_tokens), str(job.completion_tokens),
                      f"{job.ttft_s * 1000:.0f} ms" if job.ttft_s is not None else "-",
                      f"{rate:.1f}" if rate else "-")
    if len(jobs) > _TABLE_ROWS:
        table.caption = f"and {len(jobs) - _TABLE_ROWS} more"
    return table


class ServeScreen:
    """Rich Live over the pool panel, the request table and the log; redrawn a few times a second."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self._lines: deque[str] = deque(maxlen=_LOG_LINES)
        self._engine_thread: Any = None
        self._live = Live(get_renderable=self._render, console=self.console,
                          refresh_per_second=_REFRESHES_PER_S, transient=False)

    def attach(self, engine_thread: Any) -> None:
        self._engine_thread = engine_thread

    def add_line(self, line: str) -> None:
        self._lines.append(line)

    def _render(self) -> RenderableType:
        if self._engine_thread is None:
            return Text("starting ...")
        thread = self._engine_thread
        stats = thread.snapshot
        header = Text(f"running {stats.num_running} · waiting {stats.num_waiting} · queued or running "
                      f"{thread.pending} · preemptions {stats.num_preemptions} · prefix hits "
                      f"{stats.prefix_hit_rate:.0%}", style="bold")
        log = Text("\n".join(self._lines) or "no requests yet", style="dim")
        return Group(pool_panel(stats), header, requests_table(thread.running_jobs(), time.perf_counter()), log)

    def __enter__(self) -> ServeScreen:
        self._live.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._live.stop()
