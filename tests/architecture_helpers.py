"""What the architecture equality tests share (tests/test_new_architectures.py, test_moe_architectures.py):
the CPU level a test runs at, a float32 engine over a tiny model, and the transformers model it is held to."""

from __future__ import annotations

import pytest
import torch

from native_levels import COMPILED_LEVELS
from pagecli import native
from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.models.loader import load_model

LEVELS = ["torch", *COMPILED_LEVELS]


@pytest.fixture
def at_level(monkeypatch):
    def use(level: str) -> None:
        monkeypatch.setenv("PAGECLI_CPU_ISA", level)
        monkeypatch.setattr(native, "_state", {})  # the kernels of this level, built or loaded afresh

    return use


def engine_for(folder, **config) -> Engine:
    settings = {"attention": "torch", "num_blocks": 128, "block_size": 4, "disk_cache": False, **config}
    cfg = EngineConfig(dtype="float32", device="cpu", **settings)
    return Engine(config=cfg, loaded=load_model(folder, "float32", "cpu", max_positions=512))


def transformers_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
