"""The Triton kernels compile for real NVIDIA targets (sm_80, sm_90) on this CPU-only machine, without
spills and within shared memory: `python -m pagecli.attention.aot` on a sample covering every axis value.

Runs on the CPU (Triton compiles ahead of time with the ptxas its wheel ships); nothing here needs a GPU.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from aot_runs import compiled_report, run_check
from pagecli.attention import aot
from pagecli.kernels.occupancy import ARCHS, theoretical_occupancy


def _aot(*args: str) -> subprocess.CompletedProcess:
    return run_check("pagecli.attention.aot", *args)


@pytest.mark.timeout(300)
def test_every_axis_value_compiles_for_sm80_sm86_and_sm90_without_spills_within_shared_memory():
    # sm_86 (and sm_89, alike here) holds less shared memory and spilled where sm_80 did not (a 16-bit prefill
    # over an int8 cache at head size 256, at 8 warps).
    report = {"results": compiled_report("pagecli.attention.aot", "--sample", "--arch", "80,86,90")}
    kernels = {(r["kernel"], r["arch"]) for r in report["results"]}
    assert kernels == {(k, a) for k in ("store_kv", "decode", "merge_splits", "prefill") for a in (80, 86, 90)}
    # The quantized-cache variants (--kv-dtype int8|fp8) of the kernels that touch the cache, with every model dtype.
    quantized = {(r["kernel"], r["arch"], r["dtype"]) for r in report["results"] if "+kv-" in r["dtype"]}
    assert quantized == {(k, a, f"{d}+kv-{f}") for k in ("store_kv", "decode", "prefill") for a in (80, 86, 90)
                         for d in ("bf16", "fp16", "fp32") for f in ("int8", "fp8")}
    assert all(0 < r["registers"] <= 255 and r["occupancy"] > 0 for r in report["results"])
    # The soft-capped, sliding-window kernels (Gemma) compiled for every target too.
    masked = {(r["kernel"], r["arch"]) for r in report["results"] if "window=1 cap=1" in r["specialization"]}
    assert masked == {(k, a) for k in ("decode", "prefill") for a in (80, 86, 90)}


def test_the_sample_covers_every_value_of_every_axis():
    cases = aot.covering_sample()
    full = aot.full_matrix()
    for axis in ("dtype", "block_size", "num_splits", "layout", "kv_dtype"):
        assert {getattr(c, axis) for c in cases} == {getattr(c, axis) for c in full}
    quantized = [c for c in cases if c.kv_dtype != "auto"]
    assert {(c.kv_dtype, c.dtype) for c in quantized} == {(k, d) for k in ("int8", "fp8") for d in aot.DTYPES}
    assert {c.shape.head_dim for c in quantized} == {s.head_dim for s in aot.MODEL_SHAPES}
    assert {c.shape.head_dim for c in cases} == {s.head_dim for s in aot.MODEL_SHAPES}
    assert {c.shape.num_heads // c.shape.num_kv_heads for c in cases} == {
        s.num_heads // s.num_kv_heads for s in aot.MODEL_SHAPES}
    # Gemma's soft-capped, sliding layers: every dtype over a float and a quantized cache, both its head sizes.
    masked = [c for c in cases if c.masked]
    assert {(c.dtype, c.kv_dtype) for c in masked} == {(d, k) for d in aot.DTYPES for k in ("auto", "int8")}
    assert {c.shape.head_dim for c in masked} == {128, 256}
    assert all(c.shape.name.startswith("Gemma") for c in masked)


def test_matrix_comes_from_the_backends_launches_with_tile_shapes_and_hints():
    run = _aot("--list", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    specs = json.loads(run.stdout)
    llama_8b = [s for s in specs if "Llama-3.1-8B/Mistral-7B" in s["models"] and s["dtype"] == "bf16"]
    assert {s["kernel"] for s in llama_8b} == {"store_kv", "decode", "merge_splits", "prefill"}
    decodes = [s["constexprs"] for s in llama_8b if s["kernel"] == "decode"]
    assert {(d["GROUP"], d["HEAD_DIM_PAD"]) for d in decodes} == {(4, 128)}
    assert {d["NUM_SPLITS"] for d in decodes} == set(aot.NUM_SPLITS)
    assert {d["BLOCK_SIZE"] for d in decodes} == set(aot.BLOCK_SIZES)
    prefill = next(s["constexprs"] for s in llama_8b if s["kernel"] == "prefill")
    assert prefill["BLOCK_Q"] * prefill["GROUP"] <= prefill["BLOCK_M"]
    decode = next(s for s in llama_8b if s["kernel"] == "decode")
    assert "stride_cache_block" in decode["divisible_args"]  # Triton's 16-divisibility hint, as at launch
    # The block table's width varies per step: divisible by 16, not, or 1 (folded into a constant).
    table_hints = {("stride_table_seq" in s["divisible_args"], s["constexprs"].get("stride_table_seq"))
                   for s in llama_8b if s["kernel"] == "decode"}
    assert table_hints == {(True, None), (False, None), (False, 1)}
    # A quantized cache: the same kernels read its rows as bytes (int8 or uint8) with the scale behind them.
    for kv_format in ("int8", "fp8"):
        launched = [s for s in specs
                    if "Llama-3.1-8B/Mistral-7B" in s["models"] and s["dtype"] == f"bf16+kv-{kv_format}"]
        assert {s["kernel"] for s in launched} == {"store_kv", "decode", "prefill"}
        assert all(s["constexprs"]["KV_FORMAT"] == kv_format for s in launched)


def test_the_matrix_is_recorded_per_target_with_the_tiles_each_target_launches():
    """16-bit prefill takes a wider K/V tile on sm_90 than on sm_80 (kernels/prefill.py prefill_tiles)."""
    tiles = {}
    for arch in (80, 90):
        run = _aot("--list", "--json", "--arch", str(arch))
        assert run.returncode == 0, run.stderr[-2000:]
        tiles[arch] = {(s["constexprs"]["BLOCK_N"], s["num_warps"]) for s in json.loads(run.stdout)
                       if s["kernel"] == "prefill" and s["dtype"] == "bf16" and s["constexprs"]["HEAD_DIM_PAD"] == 64}
    assert tiles == {80: {(32, 8)}, 90: {(128, 4)}}


def _result(**overrides) -> aot.CompileResult:
    base = aot.CompileResult("decode", "g=4", "bf16", "test", 90, registers=96, smem_bytes=40_000, num_warps=4,
                             occupancy=0.31, occupancy_limited_by="registers")
    return aot.check(aot.CompileResult(**{**base.__dict__, **overrides}))


def test_checker_passes_a_clean_kernel_and_names_spills_oversized_smem_and_failed_compiles():
    assert _result().problems == ()
    assert _result(spill_bytes=24).problems == ("spills 24 bytes",)
    ada_limit = ARCHS[86].smem_per_block_bytes
    assert _result(arch=86, smem_bytes=120_000).problems == (f"shared memory 120000 B > {ada_limit} B",)
    assert _result(error="PTXASError: boom").problems == ("compile failed: PTXASError: boom",)


def test_a_spilled_or_oversized_result_makes_the_command_fail(monkeypatch, capsys):
    fake = [_result(spill_bytes=8), _result(smem_bytes=300_000)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(aot, "collect", lambda cases, arch=None: {})
    monkeypatch.setattr(aot, "compile_all", lambda specs, archs, jobs: fake)
    assert aot.main(["--arch", "90"]) == 1
    assert "1 spilled, 1 over shared memory" in capsys.readouterr().out
    monkeypatch.setattr(aot, "compile_all", lambda specs, archs, jobs: [_result()])
    assert aot.main(["--arch", "90"]) == 0


def test_unknown_arch_is_refused():
    assert aot.main(["--arch", "75"]) == 2


def test_occupancy_is_limited_by_what_runs_out_first():
    h100 = ARCHS[90]
    full = theoretical_occupancy(h100, registers_per_thread=32, smem_bytes=0, num_warps=4)
    assert (full.fraction, full.limited_by) == (1.0, "warps")
    spilled_regs = theoretical_occupancy(h100, registers_per_thread=255, smem_bytes=0, num_warps=4)
    assert (spilled_regs.blocks_per_sm, spilled_regs.fraction) == (2, 8 / 64)  # 8192 registers a warp
    smem_bound = theoretical_occupancy(h100, registers_per_thread=32, smem_bytes=100 * 1024, num_warps=4)
    assert (smem_bound.blocks_per_sm, smem_bound.limited_by) == (2, "shared memory")
    ada = theoretical_occupancy(ARCHS[89], registers_per_thread=32, smem_bytes=0, num_warps=4)
    assert ada.fraction == 1.0 and ada.warps_per_sm == 48


def test_ptxas_report_gives_registers_and_spilled_bytes():
    report = ("ptxas info    : Function properties for _decode_kernel\n"
              "    24 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
              "ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size\n")
    assert aot.ptxas_resources(report) == {"registers": 255, "spill_bytes": 40, "stack_bytes": 24}
    assert aot.ptxas_resources("no report") is None
