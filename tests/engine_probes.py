"""Test helpers that look inside a running Engine."""

from __future__ import annotations

import torch


def recorded_logits(engine) -> list[torch.Tensor]:
    """Wrap the engine's runner so every step's logits are kept, in step order."""
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def record(scheduled):
        logits = execute(scheduled)
        seen.append(logits.clone())
        return logits

    engine.runner.execute = record
    return seen
