"""One Ray worker: an Engine on its node, fed batches of lines by the driver and stepped between calls.

The driver holds at most one `advance` call per worker. Each call queues the lines it brings (with the
same per-line handling as the single-process run: `submit_line`, so a line's fault becomes its error
record there too), then steps the engine until some records are whole and `min_s` has passed, or
`max_s` has, or nothing is left. Records go back whole; the driver writes them. What crosses the network
is the lines' text and settings one way and finished records and a stats snapshot the other: never KV.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagecli.batch.requests import BatchRequest
from pagecli.batch.line_results import LineResults
from pagecli.config import RunSettings
from pagecli.engine.stats import EngineStats

FORWARDED_ENV_PREFIXES = ("PAGECLI_", "HF_")  # the user's pagecli and hub settings follow the job to its workers


@dataclass(frozen=True)
class WorkerReport:
    records: list[dict[str, Any]]  # whole result records, any order
    stats: EngineStats
    warnings: list[str] = field(default_factory=list)


class _Outbox:
    """Stands in for the results writer on the worker: `submit_line` saves a line's error record here."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def save(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def take(self) -> list[dict[str, Any]]:
        taken, self.records = self.records, []
        return taken


class EngineWorker:
    """The actor's class (made a Ray actor by launch.py, so this module imports without Ray)."""

    def __init__(self, settings: RunSettings, model_folder: str | None, env: dict[str, str]) -> None:
        os.environ.update(env)
        from pagecli.engine import Engine
        from pagecli.native import isa

        isa.limit_libraries()
        # The driver's resolved folder where this node has it (a local cluster, a shared disk); else the
        # model as the user named it, resolved on this node.
        model = model_folder if model_folder and Path(model_folder).is_dir() else settings.model
        self.settings = settings
        self.engine = Engine(model, settings.engine)
        self.results = LineResults()
        self.outbox = _Outbox()

    def ready(self) -> EngineStats:
        return self.engine.stats()

    def pid(self) -> int:
        return os.getpid()

    def advance(self, items: list[BatchRequest], min_s: float, max_s: float) -> WorkerReport:
        from pagecli.batch.submit import submit_line

        for item in items:
            submit_line(self.engine, self.settings, item, self.outbox, self.results)
        start = time.monotonic()
        while self.engine.has_unfinished:
            for ev in self.engine.step():
                record = self.results.add(int(ev.request_id), ev)
                if record is not None:
                    self.outbox.save(record)
            elapsed = time.monotonic() - start
            if (self.outbox.records and elapsed >= min_s) or elapsed >= max_s:
                break
        return WorkerReport(self.outbox.take(), self.engine.stats(), self.engine.take_warnings())

    def close(self) -> list[str]:
        """Waits for the disk store's writes; the warnings left."""
        self.engine.close()
        return self.engine.take_warnings()


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
