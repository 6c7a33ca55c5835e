"""`pagecli generate --ray`: the same batch job with its requests executed by Engine actors on a Ray cluster.

The driver (driver.py) reads the input and writes results exactly as the single-process path does (the
same reader, the same locked, journaled writer); only where requests run differs. Workers (worker.py)
each hold one Engine; requests reach them by prefix-aware routing (routing.py); connecting to or
starting Ray is launch.py. Ray is an optional dependency: nothing here imports it at module level.
"""

from __future__ import annotations

from pagecli.errors import PagecliError

INSTALL_HINT = "pip install 'pagecli[ray]'"


def require_ray() -> None:
    """PagecliError in one sentence when Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise PagecliError(f"--ray needs Ray, which is not installed; install it with: {INSTALL_HINT}") from None
