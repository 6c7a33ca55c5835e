"""The driver of `pagecli generate --ray`: routes the lines to the workers and saves their records.

Invariants:
- A line is in flight on at most one worker, and is saved only by a record from the worker that holds
  it, which then lets it go: no line is written twice.
- A worker holds at most `capacity` lines (backpressure) and has at most one call outstanding.
- A worker that dies, or whose call raises (out of memory, a bug: its engine's state is then unknown,
  so it is restarted), gives its lines back to the queue (front, in input order) before anything else
  is routed; if Ray restarts it, it takes lines again once its model has loaded.
- Records go to the same ResultWriter as the single-process run: the output's order, journal, lock and
  resume rules are that writer's, unchanged. Ctrl-C is checked between results, as there.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagecli.chat.turn import StopFlag
from pagecli.batch.requests import BadLine, BatchRequest
from pagecli.config import RunSettings
from pagecli.batch.results_writer import ResultWriter
from pagecli.cluster.launch import ClusterOptions, failure_reason, ray_session, start_workers, stop_workers, wait_ready
from pagecli.cluster.prompt_keys import PromptKeys
from pagecli.cluster.routing import Router
from pagecli.engine.stats import EngineStats
from pagecli.errors import PagecliError
from pagecli.ui.cluster_progress import ClusterProgress, WorkerFigures, cluster_summary
from pagecli.ui.progress import load_summary, say

MIN_CALL_S = 0.05  # a worker's call returns once it has records and has run this long...
MAX_CALL_S = 0.5  # ...or after this long in any case, so new lines and Ctrl-C are not kept waiting
CLOSE_TIMEOUT_S = 60.0


@dataclass
class WorkerState:
    name: str
    handle: Any
    stats: EngineStats
    in_flight: dict[int, BatchRequest] = field(default_factory=dict)  # line -> request, sent or not
    unsent: list[BatchRequest] = field(default_factory=list)
    call: Any = None  # its one outstanding call
    restarting: bool = False  # died; waiting to hear whether Ray brought it back
    dead: bool = False
    records: int = 0
    tokens: int = 0  # completion tokens of its records
    lost_lines: int = 0  # lines it held when it died, run again elsewhere

    @property
    def live(self) -> bool:
        return not (self.dead or self.restarting)

    def figures(self, elapsed_s: float) -> WorkerFigures:
        state = "lost" if self.dead else "restarting" if self.restarting else "up"
        return WorkerFigures(self.name, state, self.records, self.tokens, self.tokens / max(elapsed_s, 1e-9),
                             self.stats.prefix_hit_tokens, self.stats.prefix_query_tokens, self.lost_lines)


def capacity_for(settings: RunSettings) -> int:
    """Lines in flight per worker: a full batch plus as many waiting, so its engine never runs dry between calls."""
    return 2 * settings.engine.max_num_seqs


def run_on_cluster(settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
                   progress: bool | None, options: ClusterOptions) -> int:
    from pagecli.models.source import resolve_model

    if not any(isinstance(item, BatchRequest) for item in todo):  # only bad lines: their records need no Ray
        return ClusterRun(settings, todo, writer, [], None).drive(progress)
    say("Loading tokenizer ...", style="dim")
    folder = resolve_model(settings.model, lambda msg: say(msg, style="dim"))
    keys = PromptKeys(folder, settings.engine.block_size)
    with ray_session(options, settings) as plan:
        say(f"Starting {_count(plan.count, 'Ray worker')} x {_count(plan.threads, 'thread')}"
            f"{' + 1 GPU' if plan.gpus else ''} ...", style="dim")
        handles = start_workers(plan, settings, str(folder))
        try:
            ready = wait_ready(handles)
            say(load_summary(next(iter(ready.values()))), style="dim")
            workers = [WorkerState(name, handles[name], stats) for name, stats in ready.items()]
            return ClusterRun(settings, todo, writer, workers, keys).drive(progress)
        finally:
            stop_workers(handles)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


class ClusterRun:
    """One run's routing state: the queue, what each worker holds, and what has been saved."""

    def __init__(self, settings: RunSettings, todo: list[BatchRequest | BadLine], writer: ResultWriter,
                 workers: list[WorkerState], keys: PromptKeys | None) -> None:
        self.total = len(todo)
        self.writer = writer
        self.workers = workers
        self.keys = keys
        self.router = Router(capacity_for(settings))
        self.pending: deque[BatchRequest] = deque(it for it in todo if isinstance(it, BatchRequest))
        self.bad = [it for it in todo if isinstance(it, BadLine)]
        self._keys: dict[int, bytes | None] = {}
        self.errors = 0
        self.last_failure = ""
        self.start = time.perf_counter()

    def drive(self, progress: bool | None) -> int:
        for item in self.bad:
            self._save({"id": item.request_id, "line": item.line, "error": item.error})
        stop = StopFlag()  # as in the single-process run: Ctrl-C is seen between results
        try:
            with stop.catching_sigint(), ClusterProgress(self.total, progress) as bar:
                while self.pending or any(w.in_flight for w in self.workers):
                    if stop():
                        raise KeyboardInterrupt
                    self._route()
                    self._send()
                    self._collect(bar)
        except KeyboardInterrupt:
            say(f"Interrupted: {self.writer.saved} of {self.total} results saved; run the same command again "
                "to resume.", style="yellow")
            return 130
        self.writer.finish()
        self._close_engines()
        elapsed = time.perf_counter() - self.start
        say(cluster_summary(self.total, self.errors, [w.figures(elapsed) for w in self.workers], elapsed))
        return 1 if self.errors == self.total else 0

    # --- routing and calls ---------------------------------------------------------------------
    def _route(self) -> None:
        loads = {w.name: len(w.in_flight) for w in self.workers if w.live}
        by_name = {w.name: w for w in self.workers}
        while self.pending:
            item = self.pending[0]
            name = self.router.choose(self._key(item), loads)
            if name is None:
                return  # every live worker is full: wait for results
            self.pending.popleft()
            by_name[name].in_flight[item.line] = item
            by_name[name].unsent.append(item)
            loads[name] += 1

    def _key(self, item: BatchRequest) -> bytes | None:
        if item.line not in self._keys:
            self._keys[item.line] = self.keys.key(item.prompt) if self.keys else None
        return self._keys[item.line]

    def _send(self) -> None:
        for w in self.workers:
            if w.live and w.call is None and w.in_flight:
                w.call = w.handle.advance.remote(w.unsent, MIN_CALL_S, MAX_CALL_S)
                w.unsent = []

    def _collect(self, bar: ClusterProgress) -> None:
        import ray

        calls = {w.call: w for w in self.workers if w.call is not None}
        if not calls:
            if not any(not w.dead for w in self.workers):
                raise PagecliError(f"Every Ray worker has died (the last: {self.last_failure}); the "
                                   f"{self.writer.saved} results saved so far are kept: run the same command "
                                   "again to resume.")
            return
        done, _ = ray.wait(list(calls), num_returns=1, timeout=0.1)
        for ref in done:
            self._receive(calls[ref], ref)
        elapsed = time.perf_counter() - self.start
        bar.update_workers(self.writer.saved, sum(w.tokens for w in self.workers) / max(elapsed, 1e-9),
                           [w.figures(elapsed) for w in self.workers])

    def _receive(self, w: WorkerState, ref: Any) -> None:
        import ray

        w.call = None
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._lost(w, exc)
            return
        except ray.exceptions.RayTaskError as exc:  # raised in the worker (out of memory, a bug): its engine's
            say(f"Ray worker {w.name} failed ({failure_reason(exc)}); restarting it.", style="yellow")
            ray.kill(w.handle, no_restart=False)  # state is unknown, so it starts afresh like a lost one
            self._lost(w, exc)
            return
        if w.restarting:  # its `ready` answered: Ray restarted it
            w.restarting, w.stats = False, result
            return
        w.stats = result.stats
        for warning in result.warnings:
            say(f"Warning ({w.name}): {warning}", style="yellow")
        for record in result.records:
            if w.in_flight.pop(record["line"], None) is None:
                continue  # not this worker's line (cannot happen while the invariants hold)
            w.records += 1
            w.tokens += record.get("completion_tokens", 0)
            self._save(record)

    def _lost(self, w: WorkerState, exc: BaseException) -> None:
        """A worker died: its lines go back to the front of the queue; ask whether Ray brings it back."""
        self.last_failure = failure_reason(exc)
        if w.restarting:
            w.restarting, w.dead = False, True
            say(f"Ray worker {w.name} is gone ({self.last_failure}); the others go on.", style="yellow")
            return
        lines = sorted(w.in_flight.values(), key=lambda it: it.line)
        self.pending.extendleft(reversed(lines))
        w.lost_lines += len(lines)
        w.in_flight.clear()
        w.unsent = []
        w.restarting = True
        w.call = w.handle.ready.remote()  # answers after a restart; fails at once if it is dead for good

    def _save(self, record: dict[str, Any]) -> None:
        self.errors += "error" in record
        self.writer.save(record)

    def _close_engines(self) -> None:
        """Lets each live engine finish its disk-store writes, as the single-process run does."""
        import ray

        live = [w for w in self.workers if w.live]
        if not live:
            return
        try:
            warnings = ray.get([w.handle.close.remote() for w in live], timeout=CLOSE_TIMEOUT_S)
        except ray.exceptions.RayError:
            return
        for w, texts in zip(live, warnings):
            for text in texts:
                say(f"Warning ({w.name}): {text}", style="yellow")
