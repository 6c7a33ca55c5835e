"""Instruction-set levels: what a CPU runs, what PAGECLI_CPU_ISA may force, and what the user is told."""

from __future__ import annotations

import os

import pytest

from pagecli.errors import PagecliError
from pagecli.models import weight_plan
from pagecli.native import isa

XEON_AMX = "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"
ZEN4 = "avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
LAPTOP = "sse4_2 avx avx2 fma f16c"
OLD = "sse4_2 avx"


@pytest.mark.parametrize("flags, levels", [
    (XEON_AMX, ("amx", "avx512", "avx2", "torch")),
    (ZEN4, ("avx512", "avx2", "torch")),
    (LAPTOP, ("avx2", "torch")),
    (OLD, ("torch",)),
])
def test_a_cpu_runs_the_levels_its_flags_allow(flags, levels):
    assert isa.machine_levels(flags) == levels


def test_the_highest_level_is_chosen_unless_the_variable_lowers_it(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.chosen_level(ZEN4) == "avx512"
    monkeypatch.setenv(isa.ENV_VAR, "AVX2")
    assert isa.chosen_level(ZEN4) == "avx2"
    monkeypatch.setenv(isa.ENV_VAR, "auto")
    assert isa.chosen_level(XEON_AMX) == "amx"


@pytest.mark.parametrize("value, fragment", [("amx", "cannot run that level; it runs avx512, avx2, torch"),
                                             ("sse", "is not a level")])
def test_a_level_the_cpu_lacks_or_that_does_not_exist_is_refused(monkeypatch, value, fragment):
    monkeypatch.setenv(isa.ENV_VAR, value)
    with pytest.raises(PagecliError, match=fragment):
        isa.chosen_level(ZEN4)


def test_a_level_forced_down_to_avx2_computes_as_a_cpu_without_bf16_does(monkeypatch):
    # dtype auto then takes float32, as on an AVX2 CPU, not bf16 through oneDNN's AVX2 code (whose products of a
    # few rows are not each row's bits alone: a checking pass of speculation changed sampled outputs there).
    from pagecli.native import cpu_has_bf16

    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert cpu_has_bf16(ZEN4) and cpu_has_bf16(XEON_AMX)
    monkeypatch.setenv(isa.ENV_VAR, "avx2")
    assert not cpu_has_bf16(ZEN4) and not cpu_has_bf16(XEON_AMX)
    monkeypatch.setenv(isa.ENV_VAR, "avx512")
    assert cpu_has_bf16(ZEN4) and cpu_has_bf16(XEON_AMX)
    assert not cpu_has_bf16("avx2 fma f16c")  # a CPU without it, whatever is forced


def test_every_compiled_level_has_its_flags():
    assert set(isa.LEVEL_CFLAGS) == set(isa.LEVELS) - {"torch"}


@pytest.mark.parametrize("level, onednn", [("avx2", "AVX2"), ("avx512", "AVX512_CORE_BF16")])
def test_a_forced_level_caps_pytorchs_own_libraries_too(monkeypatch, level, onednn):
    monkeypatch.setenv(isa.ENV_VAR, level)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    isa.limit_libraries()

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == onednn


def test_the_users_own_library_setting_is_kept(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    isa.limit_libraries()

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "SSE41"


def test_python_m_pagecli_native_names_the_quantized_products_kernels(capsys):
    from pagecli import native
    from pagecli.native.__main__ import main

    if not native.enabled() or native.cpu_ops() is None:
        pytest.skip("no compiled kernels here")
    ops = native.cpu_ops()
    assert main() == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("==> --quantize products: "))
    for name, kind in (("int8", ops.int8_linear_kind()), ("int4", ops.int4_linear_kind())):
        assert f"{name} on {kind or 'the PyTorch reference'}" in line
    assert ("activations rounded to int8" in line) == (ops.int8_linear_kind() == "avx512_vnni")
    assert f"==> weights: {native.weight_pages()}" in out
    line = next(line for line in out.splitlines() if line.startswith("==> a float32 model's weights: "))
    assert ("bf16 where every value is a bfloat16" in line) == weight_plan.float_panels_offered(ops)


@pytest.mark.parametrize(("setting", "env", "expected"), [
    ("always [madvise] never\n", None, "2 MB pages where the kernel has them free (transparent huge pages: madvise;"),
    ("[always] madvise never\n", None, "2 MB pages where the kernel has them free (transparent huge pages: always;"),
    ("always madvise [never]\n", None, "4 KB pages (transparent huge pages are off"),
    ("always [madvise] never\n", "0", "4 KB pages (PAGECLI_HUGE_PAGES=0)"),
    (None, None, "4 KB pages (no transparent huge pages on this system)"),
])
def test_the_pages_packed_weights_get_are_said_in_words(tmp_path, monkeypatch, setting, env, expected):
    from pagecli import native

    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    monkeypatch.setattr(native, "THP_SETTING", path)
    if env is None:
        monkeypatch.delenv(native.HUGE_PAGES_VAR, raising=False)
    else:
        monkeypatch.setenv(native.HUGE_PAGES_VAR, env)
    assert native.weight_pages().startswith(expected)


def test_every_source_and_header_of_the_kernels_is_part_of_the_build_key():
    # a header left out (panel_i16.h was) lets an edit to it load the last build's kernels unchanged
    from pagecli import native

    folder = native._HERE
    assert {p.name for p in folder.glob("*.cpp")} == {p.name for p in native._SOURCES}
    assert {p.name for p in folder.glob("*.h")} == {p.name for p in native._HEADERS}
