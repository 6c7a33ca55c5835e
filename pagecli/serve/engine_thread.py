"""The one thread that runs the Engine: it takes jobs and cancellations from a thread-safe inbox, steps
the engine while anything runs, and hands each event to the job's handler. Nothing else touches the
Engine while this thread lives, and nothing here waits on an HTTP client.

Invariant: every engine request id in `_live` belongs to a job whose handler still listens; a job that
is cancelled (client gone, shutdown) has its sequences aborted at once, so its blocks go back to the pool.
A job is one engine request (its job id) whatever its n: the engine prefills the prompt once and forks
the n candidates onto the prompt's blocks; events carry the candidate's index.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from pagecli.engine.engine import RequestEvent
from pagecli.engine.stats import EngineStats
from pagecli.errors import RequestError, request_failure
from pagecli.serve import errors
from pagecli.serve.jobs import Accepted, CandidateEvent, Job, JobObserver, Rejected

log = logging.getLogger("pagecli.serve")
_IDLE_POLL_S = 0.1
_STATS_INTERVAL_S = 0.1
_SUBMIT, _CANCEL, _STOP, _COUNT = "submit", "cancel", "stop", "count"
_WATCH_S = 5.0  # after a pool-state request, how long snapshots keep each block's state (for the map)


T = TypeVar("T")


class EngineHome:
    """The one OS thread that builds the Engine (`call`) and then runs its loop (`hand_over`).

    libgomp gives every thread that opens a parallel region a team of its own, and once a process holds
    more OpenMP threads than cores, all of them sleep at their barriers instead of spinning (libgomp's
    throttled GOMP_SPINCOUNT). An engine loaded on the main thread and stepped on another therefore woke
    and slept its threads at every parallel region: 35,000 voluntary context switches in a 64-request run
    against 36, and decode steps 15-20% slower (docs/benchmarks/serve.md). One thread for both keeps
    one team."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="pagecli-engine", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn's result, computed on this thread (its exception raised here)."""
        future: Future[T] = Future()

        def task() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)

        self._calls.put(task)
        return future.result()

    def hand_over(self, fn: Callable[[], None]) -> None:
        """Run fn on this thread as its last work: the thread ends when fn returns."""
        self._calls.put(fn)
        self._calls.put(None)

    def _serve(self) -> None:
        while (task := self._calls.get()) is not None:
            task()


class EngineThread:
    """Owns the Engine from start() to stop(); HTTP handlers call submit() and cancel() only. The loop runs
    on `home`, the thread that built the engine (EngineHome says why); without one, on a thread of its own."""

    def __init__(self, engine: Any, max_pending: int, observers: Sequence[JobObserver] = (),
                 block_states: bool = False, on_warning: Callable[[str], None] | None = None,
                 home: EngineHome | None = None) -> None:
        self.engine = engine
        self.on_warning = on_warning  # the engine's warnings (a corrupt store entry, ...) as they happen
        self.max_pending = max_pending
        self.observers = list(observers)
        self.block_states = block_states
        self.snapshot: EngineStats = engine.stats(include_block_states=block_states)
        self._jobs: dict[str, Job] = {}  # job id -> job, while it runs (the request table reads it)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, Job] = {}  # engine request id (the job id) -> job
        self._pending = 0  # candidates submitted and not yet finished or cancelled
        self._lock = threading.Lock()
        self._accepting = True
        self._last_stats_s = 0.0
        self._watched_until_s = 0.0
        self._home = home
        self._thread: threading.Thread | None = None  # the home's thread, once start() hands it the loop

    # --- called from HTTP handlers -----------------------------------------------------------
    def start(self) -> None:
        home = self._home or EngineHome()
        self._thread = home.thread
        home.hand_over(self._run)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError: 429 when the queue is full, 503 while shutting down."""
        with self._lock:
            if not self._accepting:
                raise errors.shutting_down()
            if self._pending + job.n > self.max_pending:
                raise errors.queue_full(retry_after_s=1)
            self._pending += job.n
        self._inbox.put((_SUBMIT, job))

    def cancel(self, job: Job) -> None:
        """Abort whatever of the job still runs (its client went away); its blocks are freed."""
        self._inbox.put((_CANCEL, job))

    def count_tokens(self, job: Job) -> None:
        """Tokenize the job's prompt without running it: its sink gets Accepted(prompt tokens) or Rejected."""
        self._inbox.put((_COUNT, job))

    def watch_blocks(self) -> None:
        """Someone draws the pool map: the next snapshots carry each block's state (a pass over the pool
        that nobody pays for while nobody watches)."""
        self._watched_until_s = time.monotonic() + _WATCH_S

    @property
    def pending(self) -> int:
        return self._pending

    def running_jobs(self) -> list[Job]:
        """The jobs in the engine now, oldest first (a copy: the engine thread changes the set)."""
        with self._lock:
            return sorted(self._jobs.values(), key=lambda job: job.number)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self, grace_s: float) -> None:
        """Refuse new jobs, let running ones finish for up to grace_s, cancel the rest, end the thread."""
        self.stop_accepting()
        if self._thread is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + grace_s
        while self._pending and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._inbox.put((_STOP, None))
        self._thread.join()

    # --- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished):
                if self.engine.has_unfinished:
                    self._step()
                self._publish_stats()
            for job in self._live_jobs():
                self._cancel(job, errors.shutting_down())
            self._publish_stats(force=True)
        except Exception:  # noqa: BLE001 - a bug: no handler may wait forever on a dead thread
            log.exception("the engine thread failed; the server takes no more requests")
            self.stop_accepting()
            for job in self._live_jobs():
                job.sink.put(Rejected(errors.server_error()))

    def _live_jobs(self) -> list[Job]:
        return list(self._live.values())

    def _take_commands(self, block: bool) -> bool:
        """Run every queued command; False once told to stop."""
        try:
            command = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, job = command
            if kind == _STOP:
                return False
            if kind == _SUBMIT:
                self._admit(job)
            elif kind == _COUNT:
                self._count(job)
            else:
                self._cancel(job, None)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, job: Job) -> None:
        try:
            token_ids = self._prompt_ids(job)
            self.engine.add_request(token_ids, job.sampling, job.job_id)
        except errors.ApiError as error:
            self._reject(job, error)
            return
        except Exception as exc:  # noqa: BLE001 - request_failure sorts the request's fault from a bug
            message = request_failure(exc)
            if message is None:
                log.exception("request %s failed to start", job.job_id)
            self._reject(job, errors.bad_request(message) if message else errors.server_error())
            return
        job.prompt_tokens, job.status, job.candidates_left = len(token_ids), "running", job.n
        with self._lock:
            self._jobs[job.job_id] = job
        self._live[job.job_id] = job
        for observer in self.observers:
            observer.admitted(job)
        job.sink.put(Accepted(len(token_ids)))

    def _count(self, job: Job) -> None:
        try:
            job.sink.put(Accepted(len(self.engine.encode(job.prompt))))
        except errors.ApiError as error:
            job.sink.put(Rejected(error))
        except Exception as exc:  # noqa: BLE001 - request_failure sorts the request's fault from a bug
            message = request_failure(exc)
            if message is None:
                log.exception("counting the tokens of %s failed", job.job_id)
            job.sink.put(Rejected(errors.bad_request(message) if message else errors.server_error()))

    def _prompt_ids(self, job: Job) -> list[int]:
        token_ids = self.engine.encode(job.prompt)
        if not token_ids:
            raise RequestError("The prompt is empty.")
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            raise errors.context_length_exceeded(
                f"This model's context holds at most {limit} tokens; the prompt has {len(token_ids)} "
                "(and at least one must be left for the reply). Shorten the prompt or messages.")
        return token_ids

    def _reject(self, job: Job, error: errors.ApiError) -> None:
        self._release(job.n)
        job.status = "error"
        job.sink.put(Rejected(error))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception:  # noqa: BLE001 - a bug in the engine: fail what runs, keep serving
            log.exception("engine step failed; cancelling the running requests")
            for job in self._live_jobs():
                self._cancel(job, errors.server_error())
            return
        now = time.perf_counter()
        for event in events:
            job = self._live.get(event.request_id)
            if job is not None:
                self._deliver(job, event, now)

    def _deliver(self, job: Job, event: RequestEvent, now: float) -> None:
        index = event.index
        previous = job.last_token_s.get(index)
        job.last_token_s[index] = now
        job.first_token_s = job.first_token_s or now
        job.completion_tokens += len(event.token_ids)
        if index == 0:
            job.cached_tokens = event.cached_tokens
        for observer in self.observers:
            observer.token(job, None if previous is None else now - previous)
        if event.finished:  # bookkeeping first, so the handler that reads the last event sees the job done
            self._release(1)
            job.candidates_left -= 1
            if job.candidates_left == 0:
                del self._live[event.request_id]
                self._close(job, "done")
        job.sink.put(CandidateEvent(index, event))

    def _cancel(self, job: Job, error: errors.ApiError | None) -> None:
        """Abort the job's running candidates; with an error, its handler is told why."""
        if job.job_id in self._live:
            self.engine.abort(job.job_id)
            del self._live[job.job_id]
            self._release(job.candidates_left)
            self._close(job, "cancelled" if error is None else "error")
        if error is not None:
            job.sink.put(Rejected(error))

    def _close(self, job: Job, status: str) -> None:
        job.status, job.finished_s = status, time.perf_counter()
        with self._lock:
            self._jobs.pop(job.job_id, None)
        for observer in self.observers:
            observer.finished(job)

    def _release(self, candidates: int) -> None:
        with self._lock:
            self._pending -= candidates

    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_stats_s >= _STATS_INTERVAL_S or not self.engine.has_unfinished:
            with_states = self.block_states or now < self._watched_until_s
            self.snapshot = self.engine.stats(include_block_states=with_states)
            self._last_stats_s = now
            for warning in self.engine.take_warnings() if self.on_warning else ():
                self.on_warning(f"Warning: {warning}")
