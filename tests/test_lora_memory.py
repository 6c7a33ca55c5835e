"""LoRA adapters' memory: each adapter's bytes in the start-up line and in `pagecli bench memory --lora`, the
merged adapter named there, and the KV pool the same size whatever the adapters."""

from __future__ import annotations

import json

import pytest
import torch

from lora_helpers import make_adapter, one_thread  # noqa: F401 - one_thread: an autouse fixture
from pagecli.cli import main
from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.models.lora import adapter_bytes, inspect_adapter
from pagecli.ui.progress import load_summary


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-memory")
    return {"small": make_adapter(tiny_llama, root / "small", rank=4, seed=31),
            "large": make_adapter(tiny_llama, root / "large", rank=32, seed=32)}


def engine(tiny_llama, loras, **config) -> Engine:
    return Engine(str(tiny_llama), EngineConfig(device="cpu", dtype="float32", kv_budget_gib=0.01, disk_cache=False,
                                                loras=tuple((n, str(p)) for n, p in loras.items()), **config))


def test_the_start_up_line_names_each_adapters_bytes(tiny_llama, adapters):
    e = engine(tiny_llama, adapters)
    spec = e.loaded.spec
    line = load_summary(e.stats())
    for name, folder in adapters.items():
        nbytes = adapter_bytes(inspect_adapter(name, folder, spec, 64), spec, torch.float32)
        assert f" {name} {nbytes / (1 << 20):,.1f} MiB," in line
    assert "LoRA adapters small" in line and "MiB in memory (loaded on first use" in line


def test_the_kv_pool_is_the_same_size_whatever_the_adapters(tiny_llama, adapters):
    sizes = {len(loras): engine(tiny_llama, loras).stats().num_blocks
             for loras in ({}, {"small": adapters["small"]}, adapters)}
    assert len(set(sizes.values())) == 1, sizes


def test_a_merged_adapter_is_named_in_the_start_up_line(tiny_llama, adapters):
    line = load_summary(engine(tiny_llama, {"large": adapters["large"]}, merge_lora=True, quantize="none").stats())
    assert "LoRA adapter large merged into the weights" in line and "up to" not in line


def test_bench_memory_counts_each_adapter_beside_the_kv_figures(tiny_llama, adapters, tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = main(["bench", "memory", "--lengths", "100,200", "--model", str(tiny_llama), "--dtype", "float32",
                 *[arg for name, path in adapters.items() for arg in ("--lora", f"{name}={path}")], "--json", str(out)])
    assert code == 0
    document = json.loads(out.read_text())
    spec = engine(tiny_llama, {}).loaded.spec
    expected = [{"name": name, "rank": rank,
                 "bytes": adapter_bytes(inspect_adapter(name, adapters[name], spec, 64), spec, torch.float32)}
                for name, rank in (("small", 4), ("large", 32))]
    assert document["adapters"] == expected
    assert "LoRA adapters: small (rank 4)" in capsys.readouterr().out


def test_bench_memory_lora_without_a_model_is_one_sentence(adapters, capsys):
    code = main(["bench", "memory", "--lengths", "100", "--lora", f"small={adapters['small']}"])
    assert code != 0
    err = capsys.readouterr().err
    assert "--lora needs --model" in err and "Traceback" not in err
