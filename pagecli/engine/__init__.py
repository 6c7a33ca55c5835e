"""The paged engine: block pool, prefix cache, scheduler, model runner, sampler, and the Engine facade."""

from pagecli.engine.engine import Completion, Engine, RequestEvent
from pagecli.engine.stats import EngineStats

__all__ = ["Completion", "Engine", "EngineStats", "RequestEvent"]
