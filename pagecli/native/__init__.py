"""pagecli's CPU kernels (the .cpp files beside this one, one concern each), compiled once per machine
and instruction-set level into one extension, and cached.

One build per level (isa.py): `amx` (AMX tiles, AVX-512 BF16), `avx512` (AVX-512 with
BF16/VNNI where the CPU has them: Zen 4, Ice Lake), `avx2` (AVX2 + FMA: most laptops); the sources'
`#if` blocks pick each level's code. The highest level the CPU runs is used unless
PAGECLI_CPU_ISA forces a lower one (`torch`: no native kernels, the PyTorch reference path).

`cpu_ops()` returns the loaded extension, or None when it cannot be had: no C++ compiler,
PAGECLI_NATIVE=0 or PAGECLI_CPU_ISA=torch, or a failed build. Callers then take the plain PyTorch
path, which gives the same results more slowly; `unavailable_reason()` says why, for a one-line
warning. `cpu_ops_for(level)` loads another level's build beside it (tests run every level).

Threads: every product and attention kernel shares out its parallel region through work_share.h:
each thread first takes its own share, in order, as a static split would, then the units another
thread has not begun. A thread the OS holds off its core (on 2 cores: a server's clients, any other
process) no longer keeps the other waiting for its share; results stay bit-identical.

The build goes to `paths.native_dir()/<key>/` (the user cache), keyed by the sources, the torch version and
the CPU's instruction-set flags (the code is compiled for the machine it runs on). A file lock
keeps two processes from building at once; the second one loads what the first built. A finished
build leaves a stamp beside the library; later starts import the library directly, without
torch's build machinery (setuptools, and ninja run to find nothing to do: about 0.3 s).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable

from pagecli import paths
from pagecli.errors import PagecliError
from pagecli.native import isa

_HERE = Path(__file__).parent
# One file per concern, built as one extension; bindings.cpp holds the Python module.
_SOURCES = tuple(_HERE / name for name in (
    "bindings.cpp",           # the module: every entry point below, bound once
    "decode_attention.cpp",   # paged decode attention (AVX-512, AMX)
    "decode_attention_bf16.cpp",  # paged decode attention on AVX512-BF16 (bf16, fp8 caches) and VNNI (int8) dot products
    "decode_attention_tiled.cpp",  # paged decode attention in 16-token tiles: int8/fp8 caches, float ones at avx2
    "kv_quant.cpp",           # storing K/V rows into int8/fp8 caches
    "prefill_attention.cpp",  # paged prefill attention (AMX)
    "linear.cpp",             # products over row-layout weights: rows kernel, AMX tiles, native_linear
    "gemm_bf16.cpp",          # the packed bf16 GEMM (AVX512-BF16)
    "float_panels.cpp",       # float32 models at avx2: products on 16-column panels, bf16 where exact (AVX2 + FMA)
    "quant_int8.cpp",         # int8 weights: packed AVX512-BF16 kernel, AVX2 kernel
    "quant_int4.cpp",         # 4-bit weights in groups of 32 (Q4_0/Q4_1 family): AVX512-BF16, AVX2
    "elementwise.cpp",        # fused add + RMSNorm, rotary, SiLU * up
    "greedy.cpp",             # the greedy token of each logits row
    "sampling.cpp",           # a drawn token per logits row: temperature, top-k, top-p, min-p without a sort
    "weight_memory.cpp",      # the weights decode streams, in 2 MB pages
    "decode_step.cpp",        # DecodeStep: a decode-only step's layer loop
    "moe_experts.cpp",        # MoeExperts: a mixture of experts' MLP in DecodeStep
    "lora_add.cpp",           # LoRA adapters' low-rank adds over a step's rows, grouped by adapter
    "work_share.cpp",         # the tests' probe of work_share.h (threads taking over unstarted work)
    "read_probe.cpp",         # a plain read loop: the memory's read bandwidth, decode's ceiling
))
_HEADERS = tuple(_HERE / name for name in (
    "simd.h", "attention_common.h", "cpu_ops.h", "gemm_bf16.h", "float_panels.h", "panel_f32.h", "quant_int8.h",
    "quant_int4.h", "panel_i16.h", "decode_step.h", "kv_quant.h", "decode_tiles.h", "decode_attention_int8.h", "act_quant.h",
    "work_share.h", "read_probe.h", "weight_memory.h", "row_max.h", "greedy_choices.h", "lora_add.h", "tile_rows.h",
    "moe_experts.h",
))
_BASE_CFLAGS = ["-O3", "-fopenmp"]
_BUILT_STAMP = ".built"  # beside a complete library only: removed when a build starts, written when it ends
_lock = threading.Lock()
_state: dict[str, object] = {}


_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    native = os.environ.get("PAGECLI_NATIVE", "1").strip().lower() not in _OFF
    return native and isa.chosen_level(cpu_flags()) != "torch"


HUGE_PAGES_VAR = "PAGECLI_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def weight_pages() -> str:
    """In words, the pages the weights decode streams get (weight_memory.h): 2 MB where Linux's transparent huge
    pages are on in `always` or `madvise` mode and PAGECLI_HUGE_PAGES is not 0."""
    if os.environ.get(HUGE_PAGES_VAR, "1").strip().lower() in _OFF:
        return f"4 KB pages ({HUGE_PAGES_VAR}=0)"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return "4 KB pages (no transparent huge pages on this system)"
    mode = setting[setting.find("[") + 1 : setting.find("]")] if "[" in setting else setting.strip()
    if mode == "never":
        return "4 KB pages (transparent huge pages are off: `never` in " + str(THP_SETTING) + ")"
    return f"2 MB pages where the kernel has them free (transparent huge pages: {mode}; {HUGE_PAGES_VAR}=0 turns them off)"


@functools.lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux), else a processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_has_bf16(flags: str | None = None) -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX) as this process runs it: a level
    forced down to avx2 (PAGECLI_CPU_ISA) stands for a CPU without AVX-512, hence without BF16, so that it
    measures what such a CPU runs (float32 where the dtype is auto, not bf16 through oneDNN's AVX2 code, whose
    products of a few rows are not each row's bits alone: speculation's checking passes then changed sampled
    outputs)."""
    flags = cpu_flags() if flags is None else flags
    if not {"avx512_bf16", "amx_bf16"} & set(flags.split()):
        return False
    try:
        return isa.chosen_level(flags) != "avx2"
    except PagecliError:  # a PAGECLI_CPU_ISA that is not a level: said where the kernels load
        return True


def level() -> str:
    """The instruction-set level whose kernels this process runs (isa.chosen_level)."""
    return isa.chosen_level(cpu_flags())


def _cflags(level_name: str) -> list[str]:
    return [*_BASE_CFLAGS, *isa.LEVEL_CFLAGS[level_name]]


@functools.lru_cache(maxsize=None)
def build_key(level_name: str | None = None) -> str:
    """Names one build: every source and header, torch, the level's flags, this CPU and this Python."""
    import torch

    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in (*_SOURCES, *_HEADERS)), torch.__version__.encode(),
                 " ".join(_cflags(level_name or level())).encode(), cpu_flags().encode(), sys.version.encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_dir(level_name: str | None = None) -> Path:
    return paths.native_dir() / build_key(level_name)


def _build(progress: Callable[[str], None] | None, level_name: str) -> ModuleType:
    """The extension: what a finished build left for this key, else compiled (or found by ninja) now."""
    import filelock

    target = build_dir(level_name)
    paths.make_private_dir(target)
    with filelock.FileLock(str(target / ".build.lock")):
        built = _load_built(target, level_name)
        if built is not None:
            return built
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        (target / _BUILT_STAMP).unlink(missing_ok=True)  # ninja may relink (say, the source moved)
        # torch's own build baton: a build killed midway (Ctrl-C, a killed test run) leaves it, and the
        # next build would wait on it forever. Under our lock no other build is running: it is stale.
        (target / "lock").unlink(missing_ok=True)
        if progress is not None and not any(target.glob("*.so")):
            progress(f"Compiling pagecli's CPU kernels ({level_name}) for this machine (once; about a minute)")
        module = cpp_extension.load(
            name=_module_name(level_name),
            sources=[str(path) for path in _SOURCES],
            extra_include_paths=[str(_HERE)],
            extra_cflags=_cflags(level_name),
            extra_ldflags=["-fopenmp"],
            build_directory=str(target),
            verbose=False,
        )
        (target / _BUILT_STAMP).write_text(f"{module.__file__}\n")
        return module


def _module_name(level_name: str) -> str:
    return f"pagecli_cpu_ops_{build_key(level_name)}"


def is_built(level_name: str | None = None) -> bool:
    """Whether a finished build of the level's kernels (default: the chosen level) is in the cache; nothing
    is built or imported."""
    name = level_name or level()
    return _built_library(build_dir(name), name) is not None


def _built_library(target: Path, level_name: str) -> Path | None:
    """The library a finished build left in `target` (its stamp beside it), or None."""
    library = target / f"{_module_name(level_name)}.so"
    return library if (target / _BUILT_STAMP).is_file() and library.is_file() else None


def _load_built(target: Path, level_name: str) -> ModuleType | None:
    """The library a finished build left in `target`, imported as cpp_extension.load would; None if none.
    Called under the build lock: a stamp there means no build is rewriting the library."""
    library = _built_library(target, level_name)
    if library is None:
        return None
    spec = importlib.util.spec_from_file_location(_module_name(level_name), library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel installs it beside the interpreter."""
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    current = os.environ.get("PATH", "").split(os.pathsep)
    extra = [c for c in candidates if c and c not in current and os.path.exists(os.path.join(c, "ninja"))]
    if extra:
        os.environ["PATH"] = os.pathsep.join(extra + current)


def cpu_ops(progress: Callable[[str], None] | None = None) -> ModuleType | None:
    """The compiled kernels of this process's level, building them on first use; None when unavailable."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module: ModuleType | None = None
        if not enabled():
            _state["reason"] = "PAGECLI_NATIVE=0 is set" if level() != "torch" else "PAGECLI_CPU_ISA=torch is set"
        else:
            try:
                module = _build(progress, level())
            except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch path
                _state["reason"] = f"building them failed ({_first_error(exc)})"
        _state["module"] = module
        return module


def cpu_ops_for(level_name: str, progress: Callable[[str], None] | None = None) -> ModuleType:
    """The kernels built for `level_name` (one of isa.machine_levels() other than torch), beside this
    process's own; raises when they cannot be built."""
    if level_name not in isa.machine_levels(cpu_flags()) or level_name == "torch":
        raise ValueError(f"this CPU cannot run the '{level_name}' kernels")
    with _lock:
        return _build(progress, level_name)


def _first_error(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower() and not line.startswith("[")]  # compiler messages
    return (errors or lines or [type(exc).__name__])[0][:200]


def unavailable_reason() -> str | None:
    return _state.get("reason")  # type: ignore[return-value]

