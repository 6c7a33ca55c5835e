"""The paged engine: block pool, prefix cache, scheduler, model runner, sampler, and the Engine facade.

The names below load on first use (PEP 562), so a light part such as `pagecli.engine.stats` imports
without the engine and torch: `pagecli --help` and the listings never pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagecli.engine.engine import Completion, Engine, RequestEvent
    from pagecli.engine.stats import EngineStats

_HOMES = {"Completion": "pagecli.engine.engine", "Engine": "pagecli.engine.engine",
          "RequestEvent": "pagecli.engine.engine", "EngineStats": "pagecli.engine.stats"}

__all__ = ["Completion", "Engine", "EngineStats", "RequestEvent"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pagecli.engine' has no attribute '{name}'")
    return getattr(importlib.import_module(home), name)
