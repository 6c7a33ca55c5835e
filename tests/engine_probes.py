"""Test helpers that look inside a running Engine."""

from __future__ import annotations

import torch


def recorded_logits(engine) -> list[torch.Tensor]:
    """Wrap the engine's runner so every step's logits are kept, in step order: one row a running sequence, so
    the engine decodes plainly from here (speculation's checking steps have a row per draft; that they give plain
    decoding's tokens is tests/test_speculation.py's)."""
    engine.speculator = None
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def record(scheduled, greedy=False):
        logits, choices = execute(scheduled, greedy)
        seen.append(logits.clone())
        return logits, choices

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


def float32_engine(model: str, quantize: str = "none"):
    """A float32 CPU engine for comparing one model's paths: no disk store, a small pool."""
    from pagecli.config import EngineConfig
    from pagecli.engine import Engine

    return Engine(model, EngineConfig(dtype="float32", device="cpu", quantize=quantize, disk_cache=False,
                                      num_blocks=64))


def greedy_tokens(model: str, prompts: list[str], sampling, quantize: str = "none") -> list[list[int]]:
    with float32_engine(model, quantize) as running:
        return [list(out.token_ids) for out in running.generate(prompts, sampling)]


def record_tensor_reads(monkeypatch) -> list[str]:
    """The tensor names the loader reads from here on (loader._read_tensors), in order."""
    from pagecli.models import loader

    read: list[str] = []
    real = loader._read_tensors

    def spy(names, *rest):
        read.extend(names)
        return real(names, *rest)

    monkeypatch.setattr(loader, "_read_tensors", spy)
    return read
