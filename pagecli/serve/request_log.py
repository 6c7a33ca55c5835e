"""One line per answered request, for a server whose output is not a terminal (and for the screen's
log): method, path, status, and for a completion its tokens, cache hits, TTFT and speed."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from pagecli.serve.jobs import Job


def request_line(method: str, path: str, status: int, job: Job | None, error: str | None = None) -> str:
    line = f"{time.strftime('%H:%M:%S')} {method} {path} {status}"
    if job is not None and job.prompt_tokens:  # admitted: it has figures to show
        ttft = f"{job.ttft_s * 1000:.0f} ms" if job.ttft_s is not None else "-"
        rate = job.tokens_per_s(time.perf_counter())
        line += (f" #{job.number} n={job.n} prompt {job.prompt_tokens} (cached {job.cached_tokens}) completion "
                 f"{job.completion_tokens} TTFT {ttft} {f'{rate:.1f} tok/s' if rate else '-'} {job.status}")
    if error:
        line += f" error: {error}"
    return line


class RequestLog:
    """Writes request lines to a stream, or hands them to the screen (which shows the latest ones)."""

    def __init__(self, stream: TextIO | None = None, sink: Callable[[str], None] | None = None) -> None:
        self._stream = stream or sys.stderr
        self._sink = sink

    def answered(self, method: str, path: str, status: int, job: Job | None = None,
                 error: str | None = None) -> None:
        self.note(request_line(method, path, status, job, error))

    def note(self, line: str) -> None:
        """A line about the server itself (stopping, say), where the request lines go."""
        if self._sink is not None:
            self._sink(line)
            return
        print(line, file=self._stream, flush=True)
