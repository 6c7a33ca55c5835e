"""The segmented LoRA kernels compile for real NVIDIA targets (sm_80, sm_86, sm_90) on this CPU-only machine, without
spills, within shared memory and at 25% occupancy or more: `python -m pagecli.attention.aot_lora --sample`.

Runs on the CPU (Triton compiles ahead of time with the ptxas its wheel ships); nothing here needs a GPU.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from aot_runs import compiled_report, run_check
from pagecli.attention import aot, aot_lora


def _aot_lora(*args: str) -> subprocess.CompletedProcess:
    return run_check("pagecli.attention.aot_lora", *args)


@pytest.mark.timeout(300)
def test_the_lora_kernels_compile_for_sm80_sm86_and_sm90_without_spills_at_a_quarter_occupancy_or_more():
    report = {"results": compiled_report("pagecli.attention.aot_lora", "--sample", "--arch", "80,86,90")}
    compiled = {(r["kernel"], r["arch"], r["dtype"]) for r in report["results"]}
    assert compiled == {(k, a, d) for k in ("lora_shrink", "lora_expand") for a in (80, 86, 90)
                        for d in ("bf16", "fp16", "fp32")}
    assert all(0 < r["registers"] <= 255 for r in report["results"])
    low = [f"sm_{r['arch']} {r['kernel']} {r['dtype']} {r['specialization']}: {r['occupancy']:.0%}"
           for r in report["results"] if r["occupancy"] < aot.LOW_OCCUPANCY]
    assert low == [], "\n".join(low)


def test_the_matrix_comes_from_the_launches_of_each_product_with_decode_and_prefill_tiles():
    run = _aot_lora("--list", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    specs = json.loads(run.stdout)
    every_model = {shape.name for shape in aot_lora.LORA_MODEL_SHAPES}
    assert {model for s in specs for model in s["models"]} == every_model
    rows = {(s["kernel"], s["dtype"], s["constexprs"]["BLOCK_M"]) for s in specs}
    kernels = ("lora_shrink", "lora_expand")
    sixteen_bit = {(k, d, m) for k in kernels for d in ("bf16", "fp16") for m in (16, 32, 64)}
    assert rows == sixteen_bit | {(k, "fp32", m) for k in kernels for m in (16, 32)}  # float32: at most 32 rows
    # Rank tiles: 16 for rank 8 (o_proj), 32 for the fused qkv of rank 8 (24 rows of A), 64 for rank 64.
    assert {s["constexprs"]["BLOCK_R"] for s in specs if s["kernel"] == "lora_shrink"} == {16, 32, 64}
    # The tile count changes every step: never a hint, never a recompile.
    assert all("num_tiles" not in s["divisible_args"] and "num_tiles" not in s["constexprs"] for s in specs)


def test_the_sample_covers_every_pair_of_dtype_layout_and_rank():
    cases = aot_lora.covering_sample()
    for first, second in (("dtype", "layout"), ("dtype", "rank"), ("layout", "rank")):
        full = {(getattr(c, first), getattr(c, second)) for c in aot_lora.full_matrix()}
        assert {(getattr(c, first), getattr(c, second)) for c in cases} == full


def test_an_unknown_arch_is_refused():
    assert aot_lora.main(["--arch", "75"]) == 2
