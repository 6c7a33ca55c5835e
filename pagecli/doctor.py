"""What `pagecli doctor` reports: versions, GPU, CPU features, the native kernels, what a default run picks
here and why, cache folders and the embedded model; what a user pastes into a bug report.

Gathered without building kernels, compiling Triton or loading a model, so it answers in well under 3 s;
`--quick` leaves out the sections that need torch (GPU, native kernels, default run) and answers in 0.3 s.
Each finding is a `Finding`; one that points at a problem (or a missing capability) says what to do.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

OK, NOTE, PROBLEM = "ok", "note", "problem"
# /proc/cpuinfo flags pagecli's CPU kernels use (pagecli/native/isa.py), in the order a reader scans them.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Finding:
    section: str
    name: str
    value: str
    status: str = OK  # ok, note (a capability this machine lacks), problem (something to fix)
    action: str = ""  # what to do, for notes and problems


@dataclass(frozen=True)
class DoctorReport:
    findings: tuple[Finding, ...]
    seconds: float

    @property
    def problems(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == PROBLEM)

    def to_json(self) -> str:
        return json.dumps({"seconds": round(self.seconds, 3), "problems": len(self.problems),
                           "findings": [asdict(f) for f in self.findings]}, indent=2)


def gather(quick: bool = False) -> DoctorReport:
    """Every finding, section by section; a section that raises becomes one problem line, not a crash.
    quick: only the sections that need no torch (versions from the packages' metadata, CPU, caches, the
    embedded model), in a blink; GPU, native kernels and the default run are named as skipped."""
    start = time.perf_counter()
    findings: list[Finding] = []
    if quick:
        sections: tuple[tuple[str, Callable[[], list[Finding]]], ...] = (
            ("versions", lambda: _versions(None)),
            ("cpu", _cpu),
            ("caches", _caches),
            ("embedded model", _embedded_model),
            ("skipped", lambda: [Finding("skipped", "--quick", "gpu, native kernels, default run", NOTE,
                                         "run `pagecli doctor` without --quick for them (imports torch: about 2 s)")]),
        )
    else:
        import torch  # for its version, torch.cuda and the engine's selection rules; about 1 s when not yet imported

        sections = (
            ("versions", lambda: _versions(torch)),
            ("gpu", lambda: _gpu(torch)),
            ("cpu", _cpu),
            ("native kernels", _native),
            ("default run", lambda: _default_run(torch)),
            ("caches", _caches),
            ("embedded model", _embedded_model),
        )
    for section, gather_section in sections:
        try:
            findings += gather_section()
        except Exception as exc:  # noqa: BLE001 - doctor reports what it could not check
            findings.append(Finding(section, "error", f"{type(exc).__name__}: {exc}", PROBLEM,
                                    "please report this with the rest of this output"))
    return DoctorReport(tuple(findings), time.perf_counter() - start)


# --- versions and devices ------------------------------------------------------------------------------


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions(torch: Any) -> list[Finding]:
    """torch None (--quick): torch's version from its package metadata, without importing it."""
    from pagecli import __version__

    findings = [
        Finding("versions", "pagecli", __version__),
        Finding("versions", "python", f"{platform.python_version()} ({sys.executable})"),
    ]
    names = ("torch", "triton", "transformers") if torch is None else ("triton", "transformers")
    if torch is not None:
        findings.append(Finding("versions", "torch", torch.__version__))
    for name in names:
        version = _version_of(name)
        if version is None:
            needed = name in ("torch", "transformers") or sys.platform == "linux"
            findings.append(Finding("versions", name, "not installed", PROBLEM if needed else NOTE,
                                    f"pip install {name}" if needed else "triton runs on Linux only"))
        else:
            findings.append(Finding("versions", name, version))
    return findings


def _gpu(torch: Any) -> list[Finding]:
    """CUDA: whether torch sees a GPU, which, and whether the kernels can be compiled for one here."""
    return [*_cuda_devices(torch), _gpu_compiler()]


def _cuda_devices(torch: Any) -> list[Finding]:
    cuda_build = torch.version.cuda
    if cuda_build is None:
        return [Finding("gpu", "cuda", f"unavailable: torch {torch.__version__} is a CPU-only build", NOTE,
                        "for the GPU path install a CUDA build of torch "
                        "(https://pytorch.org/get-started/locally/); runs here use the CPU")]
    if not torch.cuda.is_available():
        return [Finding("gpu", "cuda", f"unavailable: torch is built for CUDA {cuda_build} but sees no GPU", NOTE,
                        "check `nvidia-smi` and CUDA_VISIBLE_DEVICES; runs here use the CPU")]
    findings = [Finding("gpu", "cuda", f"available (torch built for CUDA {cuda_build}), "
                                       f"{torch.cuda.device_count()} device(s)")]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        capability = props.major * 10 + props.minor
        findings.append(Finding("gpu", f"device {index}", f"{props.name}, sm_{capability}, "
                                                          f"{props.total_memory / 2**30:.1f} GiB"))
        from pagecli.kernels.occupancy import ARCHS

        if capability < min(ARCHS):
            findings.append(Finding("gpu", f"device {index} kernels", f"sm_{capability} is older than the "
                                    f"targets pagecli's Triton kernels are checked for", PROBLEM,
                                    "use --attention torch if the Triton kernels fail on it"))
    return findings


def _gpu_compiler() -> Finding:
    """Whether Triton can compile pagecli's kernels for NVIDIA targets here (it needs no GPU for that)."""
    ptxas = _triton_ptxas()
    if ptxas is None:
        return Finding("gpu", "compiler", "no ptxas in a triton wheel: the kernels cannot be compiled here", NOTE,
                       "pip install triton (Linux) to check them with `python -m pagecli.attention.aot`")
    return Finding("gpu", "compiler", f"triton's ptxas ({ptxas}); `python -m pagecli.attention.aot --arch 80,90` "
                                      "compiles every kernel specialization for those GPUs, here")


def _triton_ptxas() -> Path | None:
    """The ptxas inside the triton wheel, found without importing triton (about a second)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    ptxas = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas if ptxas.is_file() else None


# --- CPU and native kernels ----------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else the platform's processor or machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu() -> list[Finding]:
    from pagecli import native
    from pagecli.native import isa

    flags = set(native.cpu_flags().split())
    present = [flag for flag in CPU_FLAGS if flag in flags]
    absent = [flag for flag in CPU_FLAGS if flag not in flags]
    flags_text = " ".join(present) or "none"
    if absent:
        flags_text += f"  (absent: {' '.join(absent)})"
    findings = [
        Finding("cpu", "model", f"{cpu_model()}, {os.cpu_count()} logical cores"),
        Finding("cpu", "flags", flags_text),
        _amx_finding(flags),
    ]
    levels = isa.machine_levels(native.cpu_flags())
    from pagecli.errors import PagecliError

    try:
        level = native.level()
    except PagecliError as exc:
        return [*findings, Finding("cpu", "isa level", "invalid", PROBLEM, str(exc))]
    forced = os.environ.get(isa.ENV_VAR, "").strip().lower()
    why = (f"{isa.ENV_VAR}={forced} forces it" if forced and forced != "auto"
           else f"the highest this CPU runs ({isa.ENV_VAR} may force a lower one)")
    findings.append(Finding("cpu", "isa level", f"{level} of {', '.join(levels)}: {why}"))
    return findings


def _amx_finding(flags: set[str]) -> Finding:
    """AMX needs the CPU (flags) and the kernel's permission for the tile state (Linux 5.16+)."""
    if "amx_tile" not in flags:
        return Finding("cpu", "amx", "not on this CPU: the avx512 or avx2 kernels run instead")
    granted = _amx_permission()
    if granted is None:
        return Finding("cpu", "amx", "on this CPU; whether the OS grants it could not be checked")
    if granted:
        return Finding("cpu", "amx", "on this CPU and granted by the OS")
    return Finding("cpu", "amx", "on this CPU but the OS refuses the tile state", PROBLEM,
                   "AMX needs Linux 5.16 or newer; upgrade the kernel (or PAGECLI_CPU_ISA=avx512)")


def _amx_permission() -> bool | None:
    """Ask Linux for the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), as the kernels do at start."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    import ctypes

    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        args = (ctypes.c_long(sys_arch_prctl), ctypes.c_long(arch_req_xcomp_perm), ctypes.c_long(xfeature_xtiledata))
        return libc.syscall(*args) == 0
    except (OSError, AttributeError):
        return None


def _native() -> list[Finding]:
    """Whether the compiled CPU kernels exist for this level, where, and if not why: nothing is built here."""
    from pagecli import native
    from pagecli.errors import PagecliError

    try:
        level = native.level()
    except PagecliError as exc:
        return [Finding("native kernels", "state", "unknown", PROBLEM, str(exc))]
    if not native.enabled():
        reason = "PAGECLI_CPU_ISA=torch is set" if level == "torch" else "PAGECLI_NATIVE=0 is set"
        return [Finding("native kernels", "state", f"off: {reason}", NOTE,
                        "unset it for the faster compiled CPU kernels")]
    folder = native.build_dir(level)
    if native.is_built(level):
        return [Finding("native kernels", "state", f"built ({level}) in {folder}")]
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        return [Finding("native kernels", "state", "not built, and no C++ compiler found", PROBLEM,
                        "install g++ (e.g. apt install g++), then run `python -m pagecli.native`; "
                        "until then runs take the slower PyTorch path")]
    return [Finding("native kernels", "state", f"not built yet for {level} (would go to {folder})", NOTE,
                    "run `python -m pagecli.native` to build them now (about a minute); "
                    "otherwise the first CPU run does")]


# --- what a default run picks ----------------------------------------------------------------------


def _default_run(torch: Any) -> list[Finding]:
    """Device, attention backend and dtype that `pagecli chat` with no flags takes here, by the engine's own rules."""
    from pagecli.attention import select_backend
    from pagecli.config.settings import EngineConfig
    from pagecli.models.loader import cpu_has_bf16, resolve_device, resolve_dtype
    from pagecli.models.weight_plan import blocks_choose_float32

    from pagecli.errors import PagecliError

    config = EngineConfig()
    device = resolve_device(config.device)
    try:
        backend = select_backend(config.attention, device)
    except PagecliError as exc:  # triton missing or broken on a GPU machine
        return [Finding("default run", "attention", f"{config.attention}: unavailable", PROBLEM, str(exc))]
    if device.type == "cuda":
        backend_why = "a CUDA device is available: pagecli's Triton kernels"
    else:
        backend_why = ("no CUDA device: gather by block table + PyTorch attention, with the native CPU "
                       "kernels for decode where built")
    stored = _default_model_stored_dtype()
    dtype = resolve_dtype(config.dtype, SimpleNamespace(dtype=stored), device)
    ops, gguf_types = _default_kernels_and_blocks(device)
    blocks_float32 = dtype == torch.bfloat16 and blocks_choose_float32(config.quantize, device, ops, gguf_types,
                                                                       one_stream=True)  # chat: one stream
    if blocks_float32:
        dtype = torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        dtype_why = f"the model stores {stored}; a GPU runs 16-bit"
    elif blocks_float32:
        dtype_why = (f"the model stores {stored}; this CPU computes bfloat16 natively, but float32 runs the GGUF "
                     "file's own blocks on the int16 kernels, faster and closer to the file for one stream (chat, "
                     "a one-line generate; many sequences at once take bfloat16)")
    elif dtype == torch.bfloat16:
        dtype_why = f"the model stores {stored}; this CPU computes bfloat16 natively (AVX512-BF16 or AMX)"
    elif stored in ("float32", "bfloat16") and not cpu_has_bf16():
        dtype_why = f"the model stores {stored}; this CPU lacks AVX512-BF16, so float32 is faster"
    else:
        dtype_why = f"the model stores {stored}"
    weights = _default_weight_plan(dtype, device)
    return [
        Finding("default run", "device", f"{device.type} (--device {config.device})"),
        Finding("default run", "attention", f"{backend.name} (--attention {config.attention}): {backend_why}"),
        Finding("default run", "dtype", f"{dtype_name} (--dtype {config.dtype}): {dtype_why}"),
        Finding("default run", "weights", f"--quantize {config.quantize}: {weights}"),
        Finding("default run", "sampling", _default_sampling(device.type)),
    ]


def _default_kernels_and_blocks(device: Any) -> tuple[Any, Any]:
    """The CPU kernels where built (doctor compiles nothing) and the embedded model's GGUF tensor types."""
    from pagecli import native
    from pagecli.errors import PagecliError
    from pagecli.models.gguf_files import tensor_types
    from pagecli.models.source import converted_folder_for, default_model_gguf

    ops = native.cpu_ops() if device.type == "cpu" and native.enabled() and native.is_built() else None
    try:
        source = default_model_gguf()
        folder = converted_folder_for(source)  # its index, where converted, saves parsing the file
        return ops, tensor_types(source, folder if folder.is_dir() else None)
    except (PagecliError, OSError, ValueError):
        return ops, None


def _default_weight_plan(dtype: Any, device: Any) -> str:
    """The weight plan (pagecli.models.weight_plan) of the embedded model at the default settings: how its
    weights are kept and what runs them, by the engine's own rule."""
    from pagecli.config.settings import EngineConfig
    from pagecli.models.weight_plan import plan_weights

    ops, gguf_types = _default_kernels_and_blocks(device)
    plan = plan_weights(dtype, device, EngineConfig().quantize, ops, gguf_types)
    return plan.describe()


def _default_sampling(device_type: str) -> str:
    """The shipped profile's sampling, and what draws the tokens."""
    from pagecli.config.profiles import load_profile

    sampling = load_profile(None).sampling_params()
    how = ("tensor operations on the GPU" if device_type == "cuda" else
           "pagecli's CPU kernel where built (no sort of the vocabulary), else tensor operations")
    return f"temperature {sampling.temperature}, top_p {sampling.top_p} (the default profile): drawn by {how}"


def _default_model_stored_dtype() -> str:
    """The dtype the converted default model's config names; float32 (what conversion writes) before that."""
    from pagecli.models import source

    try:
        folder = source.converted_folder_for(source.default_model_gguf())
        config = json.loads((folder / "config.json").read_text())
        return str(config.get("dtype") or config.get("torch_dtype") or "float32")
    except (OSError, ValueError, source.ModelError):
        return "float32"


# --- files ---------------------------------------------------------------------------------------------


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _caches() -> list[Finding]:
    from pagecli import paths

    triton_cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    folders = (("cache", paths.cache_dir()), ("models", paths.models_dir()), ("prefix store", paths.prefix_store_dir()),
               ("native builds", paths.native_dir()), ("sessions", paths.sessions_dir()), ("triton", triton_cache))
    findings = []
    for name, folder in folders:
        value = f"{_folder_bytes(folder) / 1e6:,.1f} MB in {folder}" if folder.is_dir() else f"absent ({folder})"
        findings.append(Finding("caches", name, value))
    return findings


def _embedded_model() -> list[Finding]:
    from pagecli.models import source

    try:
        gguf = source.default_model_gguf()
    except source.ModelError as exc:
        return [Finding("embedded model", source.DEFAULT_MODEL_NAME, "not installed", PROBLEM, str(exc))]
    folder = source.converted_folder_for(gguf)
    if source.is_default_model_prepared():
        return [Finding("embedded model", source.DEFAULT_MODEL_NAME, f"converted in {folder}")]
    return [Finding("embedded model", source.DEFAULT_MODEL_NAME, f"installed ({gguf}), not converted yet", NOTE,
                    "run `pagecli models --prepare` now, or the first run converts it")]
