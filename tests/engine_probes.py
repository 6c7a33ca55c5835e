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


def assert_one_call_equals_layer_loop(model, caches: torch.Tensor, forward) -> torch.Tensor:
    """forward(cache) (one step of the model) run on two copies of caches: through the model's one-call
    DecodeStep, then with it set aside (the Python layer loop). Asserts equal outputs and equal caches, bit for
    bit; returns the cache the one-call step wrote."""
    cpp_cache, python_cache = caches.clone(), caches.clone()
    from_cpp = forward(cpp_cache)
    step, model.decode_step = model.decode_step, None
    try:
        from_python = forward(python_cache)
    finally:
        model.decode_step = step
    assert torch.equal(from_cpp, from_python)
    assert torch.equal(cpp_cache, python_cache)
    return cpp_cache
