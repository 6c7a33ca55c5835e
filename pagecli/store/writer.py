"""A background thread that writes queued runs of blocks to the store, so streaming never waits on disk.

The engine thread copies the KV out of the pool before queueing (the pool may reuse the
blocks right after), so the writer only serializes, checksums and writes CPU tensors.
`flush` waits for the queue to drain; `close` drains it and stops the thread; `pending` says
which blocks are queued or being written. The thread is
a daemon, and whoever owns the writer arranges for `close` at exit (weakref.finalize), so
pending writes finish before the process ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from pagecli.store.prefix_store import BlockRecord, PrefixStore

_STOP = None


class BackgroundWriter:
    def __init__(self, store: PrefixStore, warn: Callable[[str], None]) -> None:
        self._store = store
        self._warn = warn
        self._pending: set[bytes] = set()  # hashes of queued runs whose write has not finished
        self._queue: queue.Queue[tuple[Sequence[BlockRecord], torch.Tensor] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._then: Callable[[], None] | None = None  # what the thread runs at the stop, if it closed itself
        self.closed = False

    def submit(self, records: Sequence[BlockRecord], kv: torch.Tensor) -> None:
        """Queue blocks for writing; kv is [num_layers, 2, len(records), block_size, kv_heads, head_dim] on the CPU."""
        with self._lock:
            if self.closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagecli-prefix-store-writer", daemon=True)
                self._thread.start()
            self._pending.update(r.block_hash for r in records)
            self._queue.put((records, kv))

    def pending(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Those of these hashes that are queued or being written (written or failed: no longer pending)."""
        with self._lock:
            return self._pending.intersection(hashes)

    def flush(self) -> None:
        """Wait until every queued run is written."""
        self._queue.join()

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Write what is queued, stop the thread, then call `then` (e.g. close the store).

        Garbage collection may run the owner's finalizer on the writer thread itself, in the
        middle of a write; the thread cannot wait for itself, so it then finishes the queue,
        calls `then` and stops on its own."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            thread = self._thread
        if thread is threading.current_thread():
            self._then = then  # run by the thread once it reaches the stop
            self._queue.put(_STOP)
            return
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()
        if then is not None:
            then()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                self._queue.task_done()
                if self._then is not None:
                    self._then()
                return
            try:
                self._store.write_run(*job)
            except Exception as exc:  # noqa: BLE001 - a failed write must never take the engine down
                self._warn(f"A prefix store write failed and was skipped: {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._pending.difference_update(r.block_hash for r in job[0])
                self._queue.task_done()
