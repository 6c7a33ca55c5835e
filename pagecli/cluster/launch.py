"""Connecting to Ray (or starting it on this machine) and starting the Engine actors.

Address: --ray-address, else RAY_ADDRESS, else a local instance limited to the CPUs the workers ask
for, with no dashboard and Ray's own log lines kept off the terminal (PAGECLI_DEBUG=1 shows them). A
connection this run made is closed at the end, and the actors it started are killed; a Ray session the
caller had already opened (a notebook, a test) is left open.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from pagecli.config import RunSettings
from pagecli.cluster.worker import EngineWorker, forwarded_env
from pagecli.errors import PagecliError

MAX_RESTARTS = 2  # a worker whose node or process dies comes back this many times (and reloads the model)


@dataclass(frozen=True)
class ClusterOptions:
    address: str | None = None  # None: RAY_ADDRESS, else a local instance
    workers: int | None = None  # None: one per GPU, or the cluster's CPUs / threads_per_worker
    threads_per_worker: int | None = None  # None: --threads, else 1


@dataclass(frozen=True)
class WorkerPlan:
    count: int
    threads: int
    gpus: int  # per worker: 0 or 1


def _debug() -> bool:
    return os.environ.get("PAGECLI_DEBUG") == "1"


def local_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def plan_workers(options: ClusterOptions, settings: RunSettings, cpus: int, gpus: int) -> WorkerPlan:
    """How many workers, with how many threads and GPUs each, on a cluster with these resources."""
    threads = options.threads_per_worker or settings.engine.threads or 1
    use_gpu = settings.engine.device == "cuda" or (settings.engine.device == "auto" and gpus > 0)
    if settings.engine.device == "cuda" and gpus == 0:
        raise PagecliError("--device cuda was given but the Ray cluster has no GPUs; drop --device or add GPU nodes.")
    default = gpus if use_gpu else max(1, cpus // threads)
    return WorkerPlan(options.workers or default, threads, 1 if use_gpu else 0)


@contextmanager
def ray_session(options: ClusterOptions, settings: RunSettings) -> Iterator[WorkerPlan]:
    """Ray connected (or started) for this run; yields the worker plan."""
    import ray

    opened_here = not ray.is_initialized()
    if opened_here:
        _init(ray, options, settings)
    try:
        resources = ray.cluster_resources()
        cpus, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
        plan = plan_workers(options, settings, cpus, gpus)
        _refuse_unplaceable(plan, cpus, gpus)
        yield plan
    finally:
        if opened_here:
            ray.shutdown()


def _refuse_unplaceable(plan: WorkerPlan, cpus: int, gpus: int) -> None:
    """Workers the whole cluster cannot hold would wait for resources forever: one sentence instead."""
    if plan.count * plan.threads > cpus or plan.count * plan.gpus > gpus:
        needs = f"{plan.threads} CPU{'' if plan.threads == 1 else 's'}" + (" and 1 GPU" if plan.gpus else "")
        raise PagecliError(f"{plan.count} workers of {needs} each do not fit the Ray cluster ({cpus} CPUs, {gpus} "
                           "GPUs); lower --workers or --threads-per-worker, or add nodes.")


def _init(ray: Any, options: ClusterOptions, settings: RunSettings) -> None:
    address = options.address or os.environ.get("RAY_ADDRESS") or None
    quiet = dict(log_to_driver=_debug(), logging_level=logging.DEBUG if _debug() else logging.ERROR)
    try:
        if address:
            ray.init(address=address, **quiet)
            return
        local = plan_workers(options, settings, local_cpus(), _local_gpus(settings))
        ray.init(address="local", num_cpus=local.count * local.threads, num_gpus=local.count * local.gpus,
                 include_dashboard=False, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at '{address}'" if address else "a local Ray instance"
        raise PagecliError(f"Cannot connect to {where}: {str(exc).splitlines()[0]}") from None


def _local_gpus(settings: RunSettings) -> int:
    if settings.engine.device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def start_workers(plan: WorkerPlan, settings: RunSettings, model_folder: str) -> dict[str, Any]:
    """The actors, named w0, w1, ...; each loads the model in its own process (see `wait_ready`)."""
    import ray

    actor = ray.remote(EngineWorker).options(num_cpus=plan.threads, num_gpus=plan.gpus,
                                             max_restarts=MAX_RESTARTS, max_task_retries=0)
    worker_settings = replace(settings, engine=replace(settings.engine, threads=plan.threads))
    env = forwarded_env()
    return {f"w{i}": actor.remote(worker_settings, model_folder, env) for i in range(plan.count)}


def wait_ready(handles: dict[str, Any]) -> dict[str, Any]:
    """Each worker's first stats once its model has loaded; a worker that cannot start is one sentence."""
    import ray

    refs = {name: handle.ready.remote() for name, handle in handles.items()}
    try:
        return dict(zip(refs, ray.get(list(refs.values()))))
    except ray.exceptions.RayError as exc:
        raise PagecliError(f"A Ray worker could not start: {failure_reason(exc)}") from None


def failure_reason(exc: BaseException) -> str:
    """The last line of what a worker raised (Ray wraps it in its own traceback text)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
    return (errors[-1] if errors else lines[-1] if lines else type(exc).__name__)[:300]


def stop_workers(handles: dict[str, Any]) -> None:
    import ray

    for handle in handles.values():
        ray.kill(handle)
