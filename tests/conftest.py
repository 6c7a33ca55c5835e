"""Shared fixtures: tiny random models on disk, an isolated PAGECLI_HOME for every test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch):
    """Every test writes caches, sessions and converted models under a temp dir, never the user's."""
    home = tmp_path_factory.mktemp("pagecli-home")
    monkeypatch.setenv("PAGECLI_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(arch, **config_overrides) -> folder; built once per (arch, overrides)."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")
