"""The KV pool's size is checked against the memory free for it before any of it is allocated, every
float setting is finite, and more threads than cores is allowed with a warning (issue 26, case 10)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from chat_helpers import run_cli

from pagecli.config import EngineConfig
from pagecli.engine import Engine
from pagecli.engine import engine as engine_module
from pagecli.engine import pool_sizing
from pagecli.engine.pool_sizing import GIB, pool_num_blocks
from pagecli.errors import PagecliError
from pagecli.models.loader import load_model

TINY_KV_BYTES_PER_BLOCK = 16 * 512  # block 16 x (2 layers x 2 KV heads x 16 head dim x K and V x 4 bytes)
CPU = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--no-disk-cache", "-t", "0", "-n", "2"]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def four_gib_of_ram(monkeypatch):
    """The machine reports 4 GiB available: 3.5 GiB for the pool once 512 MiB of headroom is kept."""
    monkeypatch.setattr(pool_sizing, "available_ram_bytes", lambda: 4 * GIB)


def make_engine(folder, **config) -> Engine:
    settings = {"dtype": "float32", "device": "cpu", "attention": "torch", "disk_cache": False, **config}
    return Engine(config=EngineConfig(**settings), loaded=load_model(folder, "float32", "cpu", max_positions=512))


def test_a_kv_budget_beyond_free_ram_is_refused_naming_the_largest_that_fits(tiny_llama, four_gib_of_ram):
    with pytest.raises(PagecliError) as refused:
        make_engine(tiny_llama, kv_budget_gib=100.0)
    message = str(refused.value)
    assert "kv_budget_gib 100 asks for a 100.00 GiB KV pool" in message
    assert "4.00 GiB available, 0.50 GiB kept" in message
    assert "the largest kv_budget_gib that fits is 3.50" in message


def test_the_largest_budget_the_error_names_is_accepted(tiny_llama, four_gib_of_ram):
    engine = make_engine(tiny_llama, kv_budget_gib=3.5)
    assert engine.pool.num_blocks == int(3.5 * GIB) // TINY_KV_BYTES_PER_BLOCK


def test_the_default_budget_holds_the_same_tokens_in_a_float32_cache_as_in_bfloat16(tiny_llama, four_gib_of_ram):
    """A float32 cache (the default where the CPU has no AVX512-BF16) gets twice the default bytes; a quantized one
    keeps 0.75 GiB and so holds more tokens; a budget given is taken as it is, in bytes."""
    cpu = torch.device("cpu")
    bf16 = pool_num_blocks(EngineConfig(), cpu, TINY_KV_BYTES_PER_BLOCK // 2, value_bytes=2)
    assert bf16 == int(0.75 * GIB) // (TINY_KV_BYTES_PER_BLOCK // 2)
    assert pool_num_blocks(EngineConfig(), cpu, TINY_KV_BYTES_PER_BLOCK, value_bytes=4) == bf16
    assert pool_num_blocks(EngineConfig(), cpu, TINY_KV_BYTES_PER_BLOCK // 4, value_bytes=1) == 2 * bf16
    given = EngineConfig(kv_budget_gib=0.75)
    assert pool_num_blocks(given, cpu, TINY_KV_BYTES_PER_BLOCK, value_bytes=4) == bf16 // 2
    assert make_engine(tiny_llama).pool.num_blocks == bf16  # the tiny model's float32 cache, default budget


def test_a_default_budget_that_does_not_fit_says_it_is_the_default(tiny_llama, monkeypatch):
    monkeypatch.setattr(pool_sizing, "available_ram_bytes", lambda: 7 * GIB // 4)
    with pytest.raises(PagecliError, match=r"the default kv_budget_gib 1.5 asks for a 1.50 GiB KV pool.*"
                                           r"the largest kv_budget_gib that fits is 1.25"):
        make_engine(tiny_llama)


@pytest.mark.timeout(120)  # before the check, a billion-block pool took minutes of per-block objects, then failed
def test_num_blocks_beyond_free_ram_is_refused_before_the_pool_is_built(tiny_llama, four_gib_of_ram, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("the block pool was built before its size was checked")

    monkeypatch.setattr(engine_module, "BlockPool", no_pool)
    monkeypatch.setattr(engine_module, "ModelRunner", no_pool)
    with pytest.raises(PagecliError, match=r"num_blocks 1,000,000,000 asks for .* at most 458,752 blocks fit"):
        make_engine(tiny_llama, num_blocks=1_000_000_000)


def test_when_nothing_fits_the_error_says_so(tiny_llama, monkeypatch):
    monkeypatch.setattr(pool_sizing, "available_ram_bytes", lambda: 256 << 20)
    with pytest.raises(PagecliError, match="no KV pool fits; free some memory"):
        make_engine(tiny_llama, num_blocks=64)


def test_where_free_memory_cannot_be_read_the_configured_size_is_taken(tiny_llama, monkeypatch):
    monkeypatch.setattr(pool_sizing, "available_ram_bytes", lambda: None)
    assert make_engine(tiny_llama, num_blocks=64).pool.num_blocks == 64


def test_memory_taken_by_others_after_the_check_is_one_sentence_too(tiny_llama, monkeypatch):
    def allocator_fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 524288 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(engine_module, "ModelRunner", allocator_fails)
    with pytest.raises(PagecliError, match=r"The 0.00 GiB KV pool could not be allocated \(.*can't allocate memory"):
        make_engine(tiny_llama, num_blocks=64)


def test_free_ram_is_read_from_the_system():
    available = pool_sizing.available_ram_bytes()
    assert available is not None and 0 < available


def test_a_containers_memory_limit_counts_without_its_reclaimable_file_cache(tmp_path):
    (tmp_path / "memory.max").write_text(f"{4 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{3 * GIB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0\n")
    assert pool_sizing.cgroup_room_bytes(tmp_path) == 2 * GIB
    (tmp_path / "memory.max").write_text("max\n")
    assert pool_sizing.cgroup_room_bytes(tmp_path) is None


def test_a_cgroup_v1_limit_counts_and_its_unlimited_value_does_not(tmp_path):
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(f"{8 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory.stat").write_text(f"total_inactive_file {GIB}\n")
    assert pool_sizing.cgroup_room_bytes(tmp_path) == 7 * GIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert pool_sizing.cgroup_room_bytes(tmp_path) is None


def test_the_smaller_of_the_system_and_the_container_figure_is_available(monkeypatch):
    monkeypatch.setattr(pool_sizing, "_system_available_bytes", lambda: 20 * GIB)
    monkeypatch.setattr(pool_sizing, "cgroup_room_bytes", lambda: 3 * GIB)
    assert pool_sizing.available_ram_bytes() == 3 * GIB
    monkeypatch.setattr(pool_sizing, "cgroup_room_bytes", lambda: None)
    assert pool_sizing.available_ram_bytes() == 20 * GIB


def test_on_a_gpu_a_fraction_that_leaves_no_headroom_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 16 * GIB))
    gpu = torch.device("cuda", 0)
    with pytest.raises(PagecliError, match=r"gpu_memory_fraction 1 .* free memory on cuda:0 .* "
                                           r"the largest gpu_memory_fraction that fits is 0.95"):
        pool_num_blocks(EngineConfig(gpu_memory_fraction=1.0), gpu, TINY_KV_BYTES_PER_BLOCK)
    fits = pool_num_blocks(EngineConfig(gpu_memory_fraction=0.95), gpu, TINY_KV_BYTES_PER_BLOCK)
    assert fits == int(10 * GIB * 0.95) // TINY_KV_BYTES_PER_BLOCK


@pytest.mark.parametrize("field", ["kv_budget_gib", "gpu_memory_fraction", "disk_cache_max_gib"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_setting_must_be_finite(field, value):
    with pytest.raises(PagecliError, match=f"{field} must be a finite number"):
        EngineConfig(**{field: value})


def test_a_gib_figure_too_large_to_count_in_bytes_is_refused():
    with pytest.raises(PagecliError, match="kv_budget_gib must be positive and at most 1048576"):
        EngineConfig(kv_budget_gib=1e300)


# --- through the command line ------------------------------------------------------------------------------------
def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Unexpected" not in lines[0] and "Traceback" not in err, err
    return lines[0]


def test_kv_budget_inf_on_the_command_line_is_one_sentence(tiny_llama, capsys, monkeypatch):
    code, _, err = run_cli(["chat", str(tiny_llama), *CPU, "--kv-budget-gib", "inf"], "hi\n", capsys, monkeypatch)
    assert code == 2
    assert "kv_budget_gib must be a finite number (got inf)" in _one_error_line(err)


@pytest.mark.parametrize(("flag", "fragment"), [
    (["--kv-budget-gib", "100"], "the largest kv_budget_gib that fits is 3.50"),
    (["--num-blocks", "1000000"], "at most 458,752 blocks fit"),
])
@pytest.mark.timeout(120)
def test_a_pool_too_big_for_the_machine_is_one_sentence(flag, fragment, tiny_llama, four_gib_of_ram, capsys,
                                                         monkeypatch):
    code, _, err = run_cli(["chat", str(tiny_llama), *CPU, *flag], "hi\n", capsys, monkeypatch)
    assert code == 2
    assert fragment in _one_error_line(err)


# --- threads ---------------------------------------------------------------------------------------------------------
def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_more_threads_than_cores_runs_with_one_warning(tiny_llama):
    cores = _cores()
    engine = make_engine(tiny_llama, num_blocks=64, threads=cores + 1)
    warnings = engine.take_warnings()
    assert any(f"--threads {cores + 1} is more than this machine's {cores} cores" in w for w in warnings), warnings
    assert engine.take_warnings() == []


@pytest.mark.parametrize("threads", [0, 1025, 2**31])
def test_thread_counts_no_machine_has_are_refused(threads):
    with pytest.raises(PagecliError, match=f"threads must be between 1 and 1024 \\(got {threads}\\)"):
        EngineConfig(threads=threads)


def test_threads_within_the_cores_give_no_warning(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=64, threads=1)
    assert not any("--threads" in w for w in engine.take_warnings())
