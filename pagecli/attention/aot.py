"""Ahead-of-time compile of every Triton kernel specialization the engine launches, for NVIDIA targets, on
a machine without a GPU: `python -m pagecli.attention.aot [--arch 80,86,89,90] [--sample] [--json]`.

The matrix is not written by hand: each case (a supported model's head shape, a dtype, a block size, a
split count, a KV cache format) runs the real `TritonAttentionBackend` on meta tensors with the launches intercepted, so
every specialization recorded is one the engine makes, with the constexprs, launch options and the
16-divisibility hints Triton would derive from those arguments. Each distinct one is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` and the wheel's own ptxas, whose
report gives registers and spills. Exit status 1 when a compile fails, a kernel spills, or its shared
memory exceeds the target's per-block limit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import sys
import tempfile
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterator

from pagecli.kernels.occupancy import ARCHS, theoretical_occupancy

LOW_OCCUPANCY = 0.25  # below this a memory-bound kernel has too few warps in flight to hide latency


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry of one supported model: all the kernels see of it."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


# The supported families' head geometries (pagecli/models/spec.py), spanning their head sizes and
# GQA group sizes, and head sizes the spec also accepts (the kernels pad head_dim to a power of two).
MODEL_SHAPES = (
    ModelShape("SmolLM2-135M", 9, 3, 64),
    ModelShape("SmolLM2-360M", 15, 5, 64),
    ModelShape("SmolLM2-1.7B", 32, 32, 64),
    ModelShape("Llama-3.2-1B", 32, 8, 64),
    ModelShape("Qwen2.5-0.5B", 14, 2, 64),
    ModelShape("Llama-3.2-3B", 24, 8, 128),
    ModelShape("Llama-2-7B", 32, 32, 128),
    ModelShape("Llama-3.1-8B/Mistral-7B", 32, 8, 128),
    ModelShape("Llama-3.1-70B", 64, 8, 128),
    ModelShape("Llama-3.1-405B", 128, 8, 128),
    ModelShape("Qwen2.5-1.5B", 12, 2, 128),
    ModelShape("Qwen2.5-7B", 28, 4, 128),
    ModelShape("Qwen2.5-14B", 40, 8, 128),
    ModelShape("Qwen3-0.6B", 16, 8, 128),
    ModelShape("Gemma-2-2B", 8, 4, 256),
    ModelShape("Gemma-2-9B", 16, 8, 256),
    ModelShape("Gemma-3-1B", 4, 1, 256),
    ModelShape("Gemma-3-27B", 32, 16, 128),
    ModelShape("head_dim 32", 16, 16, 32),
    ModelShape("head_dim 96", 32, 32, 96),
    ModelShape("head_dim 256", 16, 8, 256),
)
DTYPES = ("bfloat16", "float16", "float32")  # --dtype choices on CUDA; the KV cache takes the model's dtype
BLOCK_SIZES = (8, 16, 32)  # 16 is every profile's; any size >= 1 is accepted
NUM_SPLITS = (1, 2, 4, 8, 16)  # choose_num_splits' powers of two up to MAX_SPLITS
# --kv-dtype: the model's dtype, or int8/fp8 rows with a scale (kv_format.py), which the kernels read otherwise.
KV_DTYPES = ("auto", "int8", "fp8")


@dataclass(frozen=True)
class StepLayout:
    """How a step's batch is laid out, as far as Triton's launch-time hints see it: the block table's width
    (the longest sequence's block count: divisible by 16, not, or 1, which Triton folds into a constant),
    and the decodes ahead of the prefill, whose count offsets the prefill's metadata pointers (16-byte
    aligned when it is a multiple of 4)."""

    name: str
    num_decodes: int
    table_width: int


STEP_LAYOUTS = (
    StepLayout("1 decode + prefill, table width 64", 1, 64),
    StepLayout("4 decodes + prefill, table width 37", 4, 37),
    StepLayout("1 decode + prefill, one block each", 1, 1),
)


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    dtype: str
    block_size: int
    num_splits: int
    layout: StepLayout = STEP_LAYOUTS[0]
    kv_dtype: str = "auto"
    masked: bool = False  # a Gemma layer: soft-capped scores and a sliding window (the kernels' SOFTCAP, SLIDING)


def full_matrix(layouts: tuple[StepLayout, ...] = STEP_LAYOUTS) -> list[Case]:
    """Every combination of the axes (soft-capped, sliding layers for the Gemma shapes only)."""
    axes = (MODEL_SHAPES, DTYPES, BLOCK_SIZES, NUM_SPLITS, layouts, KV_DTYPES, (False, True))
    return [Case(*combo) for combo in itertools.product(*axes) if not combo[-1] or combo[0].name.startswith("Gemma")]


def covering_sample() -> list[Case]:
    """Few cases that still take every value of every axis at least once: the head geometry split into
    its own axes (GQA group, head size, KV heads), case i takes value i mod n of each. Then fewer cases
    with quantized caches, whose kernels differ most by the dtype they widen to and the head size: case i
    takes format i mod 2 and dtype i mod 3, so every pair of the two occurs, and every head size."""
    groups = sorted({shape.num_heads // shape.num_kv_heads for shape in MODEL_SHAPES})
    head_dims = sorted({shape.head_dim for shape in MODEL_SHAPES})
    kv_heads = sorted({shape.num_kv_heads for shape in MODEL_SHAPES})
    quantized = KV_DTYPES[1:]
    axes = (groups, head_dims, kv_heads, DTYPES, BLOCK_SIZES, NUM_SPLITS, STEP_LAYOUTS)
    cases = []
    for kv_axis, num_cases in ((("auto",), max(len(axis) for axis in axes)),
                               (quantized, max(len(quantized) * len(DTYPES), len(head_dims)))):
        for i in range(num_cases):
            group, head_dim, kv, dtype, block_size, num_splits, layout = (axis[i % len(axis)] for axis in axes)
            shape = ModelShape(f"g{group} d{head_dim} kv{kv}", group * kv, kv, head_dim)
            cases.append(Case(shape, dtype, block_size, num_splits, layout, kv_axis[i % len(kv_axis)]))
    # Gemma's soft-capped, sliding layers: each dtype with each of their head sizes, a float and a quantized cache.
    gemma = [shape for shape in MODEL_SHAPES if shape.name.startswith("Gemma")]
    for i, (dtype, kv_dtype) in enumerate(itertools.product(DTYPES, ("auto", "int8"))):
        cases.append(Case(gemma[i % len(gemma)], dtype, BLOCK_SIZES[i % len(BLOCK_SIZES)],
                          NUM_SPLITS[i % len(NUM_SPLITS)], STEP_LAYOUTS[i % len(STEP_LAYOUTS)], kv_dtype, masked=True))
    return cases


@dataclass(frozen=True)
class Specialization:
    """One compile: a kernel with its signature, constexprs, divisibility hints and launch options."""

    kernel: str  # "module:function"
    signature: tuple[tuple[str, str], ...]  # (arg name, Triton type or "constexpr")
    constexprs: tuple[tuple[str, Any], ...]
    divisible_args: tuple[str, ...]  # args Triton may assume divisible by 16
    num_warps: int
    num_stages: int

    @property
    def short_name(self) -> str:
        return self.kernel.rsplit(":", 1)[1].strip("_").removesuffix("_kernel")

    @property
    def dtype(self) -> str:
        """The model's dtype: its 16-bit tensors' type, else fp32 (fp32 partials alone don't make an fp32 model);
        '+kv-int8' or '+kv-fp8' after it for a kernel on a quantized cache."""
        kinds = [kind[1:] for _, kind in self.signature if kind.startswith(("*fp", "*bf"))]
        model = next((kind for kind in kinds if kind != "fp32"), "fp32")
        kv_format = dict(self.constexprs).get("KV_FORMAT", "float")
        return model if kv_format == "float" else f"{model}+kv-{kv_format}"

    def label(self) -> str:
        """The constexprs that make this specialization, abbreviated (_ABBREVIATIONS): 'g=4 ... d=128 n=32 w4 s2'."""
        named = [f"{_ABBREVIATIONS.get(k, k)}={int(v) if isinstance(v, bool) else v}"
                 for k, v in self.constexprs if k.isupper()]
        return " ".join([*named, f"w{self.num_warps}", f"s{self.num_stages}"])


_ABBREVIATIONS = {"GROUP": "g", "GROUP_PAD": "gpad", "BLOCK_SIZE": "bs", "HEAD_DIM_PAD": "d", "BLOCK_N": "n",
                  "NUM_SPLITS": "splits", "SPLITS_PAD": "spad", "FP32_DOT": "ieee", "BLOCK_Q": "q", "BLOCK_M": "m",
                  "HEADS_PAD": "heads", "KV_FORMAT": "kv", "SLIDING": "window", "SOFTCAP": "cap",
                  "BLOCK_K": "k", "BLOCK_R": "r"}


# --- the matrix: what the backend launches --------------------------------------------------------


def launches_of(case: Case) -> list[Specialization]:
    """The kernel launches one engine step makes for this case (a decode and a prefill in one batch)."""
    import torch

    from pagecli.kv_format import resolve_kv_format
    from pagecli.attention.metadata import AttentionMetadata
    from pagecli.attention.triton_backend import TritonAttentionBackend
    from pagecli.kernels import decode

    shape, block_size, layout = case.shape, case.block_size, case.layout
    dtype = getattr(torch, case.dtype)
    device = torch.device("meta")
    num_blocks = 1024
    decode_len, prefill_len, prefix_len = 300, 40, 64  # lengths live on the device: no hint depends on them
    num_seqs = layout.num_decodes + 1
    num_tokens = layout.num_decodes + prefill_len
    # [num_tokens, (heads + 2 kv_heads) * head_dim]: q, k and v are views of one projection, as in the decoder.
    qkv = torch.empty(num_tokens, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim, dtype=dtype,
                      device=device)
    q, k, v = qkv.split([shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim,
                         shape.num_kv_heads * shape.head_dim], dim=-1)
    q = q.view(num_tokens, shape.num_heads, shape.head_dim)
    k = k.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    v = v.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    # [num_layers, 2, num_blocks, block_size, kv_heads, row], as the model runner allocates; layer 1.
    kv_format = resolve_kv_format(case.kv_dtype, dtype, shape.head_dim)
    kv_cache = torch.empty(2, 2, *kv_format.cache_shape(num_blocks, block_size, shape.num_kv_heads),
                           dtype=kv_format.storage_dtype, device=device)[1]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.empty(num_seqs, dtype=torch.int32, device=device),
        block_tables=torch.empty(num_seqs, layout.table_width, dtype=torch.int32, device=device),
        num_decode_seqs=layout.num_decodes,
        max_query_len=prefill_len,
        max_seq_len=max(decode_len, prefix_len + prefill_len),
        query_lens_host=(1,) * layout.num_decodes + (prefill_len,),
        seq_lens_host=(decode_len,) * layout.num_decodes + (prefix_len + prefill_len,),
    )
    backend = TritonAttentionBackend()
    with _recording_launches() as recorded, _forced_splits(decode, case.num_splits):
        backend.store_kv(k, v, kv_cache[0], kv_cache[1], meta)
        masked = {"softcap": 50.0, "window": 4096} if case.masked else {}
        backend.forward(q, kv_cache[0], kv_cache[1], meta, shape.head_dim**-0.5, **masked)
    return recorded


@contextlib.contextmanager
def _forced_splits(decode_module: Any, num_splits: int) -> Iterator[None]:
    """choose_num_splits asks the GPU for its SM count; stand in for a GPU that wants num_splits."""
    original = decode_module.choose_num_splits
    decode_module.choose_num_splits = lambda *_: num_splits
    try:
        yield
    finally:
        decode_module.choose_num_splits = original


@contextlib.contextmanager
def _recording_launches(module_names: tuple[str, ...] = ("decode", "prefill", "store_kv")
                        ) -> Iterator[list[Specialization]]:
    """Replace each kernel's launch (in those modules of pagecli.kernels) with a recorder of the specialization
    Triton would compile for it."""
    import importlib

    from triton.runtime.jit import JITFunction

    modules = [importlib.import_module(f"pagecli.kernels.{name}") for name in module_names]
    kernels = [value for module in modules for value in vars(module).values()
               if isinstance(value, JITFunction) and value.__name__.endswith("_kernel")]
    if not kernels:
        raise RuntimeError("the kernels are not compiled Triton functions: unset TRITON_INTERPRET")
    recorded: list[Specialization] = []
    for kernel in kernels:
        kernel.run = _recorder(kernel, recorded)  # the instance attribute shadows JITFunction.run
    try:
        yield recorded
    finally:
        for kernel in kernels:
            del kernel.run


def _recorder(kernel: Any, recorded: list[Specialization]) -> Callable[..., None]:
    def record(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorded.append(_specialization(kernel, args, kwargs))

    return record


def _specialization(kernel: Any, args: tuple, kwargs: dict) -> Specialization:
    """Triton's own specialization rule (jit.py) applied to one launch's arguments."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    signature, constexprs, divisible = [], [], []
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            kind = "constexpr"
            constexprs.append((param.name, value))
        else:
            kind, hint = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
            if kind == "constexpr":  # an int equal to 1 is folded in
                constexprs.append((param.name, hint))
            elif isinstance(hint, str) and "D" in hint:
                divisible.append(param.name)
        signature.append((param.name, kind))
    return Specialization(
        kernel=f"{kernel.fn.__module__}:{kernel.__name__}",
        signature=tuple(signature),
        constexprs=tuple(constexprs),
        divisible_args=tuple(divisible),
        num_warps=kwargs.get("num_warps", 4),
        num_stages=kwargs.get("num_stages", 3),
    )


def collect(cases: list[Case], arch: int | None = None) -> dict[Specialization, list[str]]:
    """The distinct specializations the cases launch on sm_<arch> (tiles may depend on the target), each with
    the model shapes that launch it."""
    from pagecli.kernels.common import targeting

    found: dict[Specialization, list[str]] = {}
    for case in cases:
        with targeting(arch):
            launched = launches_of(case)
        for spec in launched:
            names = found.setdefault(spec, [])
            if case.shape.name not in names:
                names.append(case.shape.name)
    return found


# --- compiling ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    specialization: str
    dtype: str
    models: str
    arch: int
    head_dim_pad: int = 0
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads, as ptxas reports them
    stack_bytes: int = 0
    smem_bytes: int = 0
    num_warps: int = 0
    occupancy: float = 0.0
    occupancy_limited_by: str = ""
    error: str = ""
    problems: tuple[str, ...] = field(default=())


def compile_one(spec: Specialization, arch: int) -> CompileResult:
    """Compile one specialization for sm_<arch> and read its resources (runs in a worker process)."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, function_name = spec.kernel.split(":")
    fn = getattr(importlib.import_module(module_name), function_name)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec.divisible_args}
    source = ASTSource(fn=fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
    base = CompileResult(spec.short_name, spec.label(), spec.dtype, "", arch,
                         head_dim_pad=dict(spec.constexprs).get("HEAD_DIM_PAD", 0), num_warps=spec.num_warps)
    knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's report to stdout
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    except Exception as exc:  # noqa: BLE001 - a failed compile is a result to report, not a crash
        return replace(base, error=_first_line(exc))
    resources = ptxas_resources(report.getvalue()) or cubin_resources(compiled.asm["cubin"])
    smem = int(compiled.metadata.shared)
    occupancy = theoretical_occupancy(ARCHS[arch], resources["registers"], smem, spec.num_warps)
    return replace(base, registers=resources["registers"], spill_bytes=resources["spill_bytes"],
                   stack_bytes=resources["stack_bytes"], smem_bytes=smem, occupancy=occupancy.fraction,
                   occupancy_limited_by=occupancy.limited_by)


def ptxas_resources(report: str) -> dict[str, int] | None:
    """Registers, spilled bytes and stack frame from `ptxas -v` output; None if it has no report."""
    registers = re.search(r"Used (\d+) registers", report)
    if registers is None:
        return None
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    return {
        "registers": int(registers.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0,
        "stack_bytes": int(stack.group(1)) if stack else 0,
    }


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """The same from the wheel's cuobjdump, for a kernel Triton took from its cache (no ptxas run).
    cuobjdump does not separate spills from the stack frame: any stack counts as spilled."""
    import subprocess

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
                               capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    stack_bytes = int(stack.group(1)) if stack else 0
    return {"registers": int(registers.group(1)) if registers else 0, "spill_bytes": stack_bytes,
            "stack_bytes": stack_bytes}


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def check(result: CompileResult) -> CompileResult:
    """The result with its problems named: a failed compile, a spill, or shared memory past the target's limit."""
    problems = []
    if result.error:
        problems.append(f"compile failed: {result.error}")
    else:
        if result.spill_bytes:
            problems.append(f"spills {result.spill_bytes} bytes")
        limit = ARCHS[result.arch].smem_per_block_bytes
        if result.smem_bytes > limit:
            problems.append(f"shared memory {result.smem_bytes} B > {limit} B")
    return replace(result, problems=tuple(problems))


def compile_all(specs: dict[Specialization, list[str]], archs: list[int], jobs: int) -> list[CompileResult]:
    """Every specialization for every target, in a process pool; each result checked."""
    work = [(spec, arch) for arch in archs for spec in specs]
    import multiprocessing

    # A fresh cache, so that ptxas runs (and reports) for every kernel; the workers inherit it.
    previous_cache = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="pagecli-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                futures = [pool.submit(compile_one, spec, arch) for spec, arch in work]
                for done, _ in enumerate(as_completed(futures), 1):
                    _progress(done, len(futures))
                results = [future.result() for future in futures]
        finally:
            if previous_cache is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous_cache
    return [check(replace(result, models=", ".join(specs[spec])))
            for (spec, _), result in zip(work, results)]


def _progress(done: int, total: int) -> None:
    """A counter on stderr, on a terminal only: the full matrix takes minutes."""
    if sys.stderr.isatty():
        print(f"\rcompiled {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


# --- report ------------------------------------------------------------------------------------------


def table(results: list[CompileResult]) -> str:
    """A Markdown table, one row per compile."""
    header = "| arch | kernel | dtype | specialization | models | regs | spill B | smem B | occupancy | status |"
    lines = [header, "|---|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        status = "; ".join(r.problems) or ("low occupancy" if r.occupancy < LOW_OCCUPANCY else "ok")
        occupancy = "" if r.error else f"{r.occupancy:.0%} ({r.occupancy_limited_by})"
        lines.append(f"| sm_{r.arch} | {r.kernel} | {r.dtype} | {r.specialization} | {r.models} | {r.registers} | "
                     f"{r.spill_bytes} | {r.smem_bytes} | {occupancy} | {status} |")
    return "\n".join(lines)


def grouped_table(results: list[CompileResult]) -> str:
    """One row per target, kernel, padded head size and dtype: the range of each resource over the group.
    Dtypes whose rows are identical (bf16 and fp16, usually) share one."""
    groups: dict[tuple[int, str, int, str], list[CompileResult]] = {}
    for r in results:
        groups.setdefault((r.arch, r.kernel, r.head_dim_pad, r.dtype), []).append(r)
    merged: dict[tuple, list[str]] = {}  # (arch, kernel, head_dim_pad, cells) -> dtypes
    for (arch, kernel, head_dim_pad, dtype), rows in sorted(groups.items()):
        compiled = [r for r in rows if not r.error] or rows
        cells = (len(rows), _span(r.registers for r in compiled), max(r.spill_bytes for r in rows),
                 _span(round(r.smem_bytes / 1024, 1) for r in compiled),
                 _span(f"{r.occupancy:.0%}" for r in compiled), sum(1 for r in rows if r.problems))
        merged.setdefault((arch, kernel, head_dim_pad, cells), []).append(dtype)
    lines = ["| arch | kernel | head dim (padded) | dtype | specializations | regs | spill B | smem KiB | occupancy "
             "| problems |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (arch, kernel, head_dim_pad, cells), dtypes in merged.items():
        lines.append(f"| sm_{arch} | {kernel} | {head_dim_pad or '-'} | {', '.join(dtypes)} | "
                     + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _span(values: Any) -> str:
    ordered = sorted(set(values), key=lambda v: float(str(v).rstrip("%")))
    return str(ordered[0]) if len(ordered) == 1 else f"{ordered[0]}–{ordered[-1]}"


def summary(results: list[CompileResult]) -> dict[str, Any]:
    return {
        "compiled": len(results),
        "failed": sum(1 for r in results if r.error),
        "spilled": sum(1 for r in results if r.spill_bytes),
        "over_smem": sum(1 for r in results if any(p.startswith("shared memory") for p in r.problems)),
        "low_occupancy": sum(1 for r in results if not r.error and r.occupancy < LOW_OCCUPANCY),
        "max_registers": max((r.registers for r in results), default=0),
        "max_smem_bytes": max((r.smem_bytes for r in results), default=0),
    }


def _print_list(specs: dict[Specialization, list[str]], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"kernel": spec.short_name, "dtype": spec.dtype, "constexprs": dict(spec.constexprs),
                           "divisible_args": spec.divisible_args, "num_warps": spec.num_warps,
                           "num_stages": spec.num_stages, "models": models} for spec, models in specs.items()],
                         indent=1))
        return
    for spec, models in specs.items():
        print(f"{spec.short_name:14} {spec.dtype:5} {spec.label():60} {', '.join(models)}")
    print(f"{len(specs)} specializations")


def parse_args(prog: str, description: str, grouped_help: str, argv: list[str] | None) -> argparse.Namespace:
    """The flags of an ahead-of-time check (this module's and aot_lora's)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--arch", default="80,86,89,90", help="compute capabilities, comma-separated (80,86,89,90)")
    parser.add_argument("--sample", action="store_true",
                        help="a covering sample (every axis value at least once) instead of the full matrix")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--grouped", action="store_true", help=grouped_help)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    parser.add_argument("--list", action="store_true", help="list the specializations and stop, compiling nothing")
    return parser.parse_args(argv)


def targets(args: argparse.Namespace) -> list[int] | None:
    """The --arch targets, or None (said on stderr) when one is unknown or Triton would only interpret."""
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        archs = []
    if not archs or any(a not in ARCHS for a in archs):
        print(f"--arch takes compute capabilities among {', '.join(map(str, ARCHS))} (got '{args.arch}').",
              file=sys.stderr)
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled; unset it to run this check.",
              file=sys.stderr)
        return None
    return archs


def report(results: list[CompileResult], num_specs: int, num_archs: int, args: argparse.Namespace) -> int:
    """Print the results (table or JSON) and their summary; the exit status: 1 when any has a problem."""
    totals = summary(results)
    if args.json:
        print(json.dumps({"summary": totals, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(grouped_table(results) if args.grouped else table(results))
        print(f"\n{num_specs} distinct specializations over {num_archs} targets: {totals['compiled']} compiled, "
              f"{totals['failed']} failed, {totals['spilled']} spilled, {totals['over_smem']} over shared memory, "
              f"{totals['low_occupancy']} below {LOW_OCCUPANCY:.0%} occupancy.")
    return 1 if any(r.problems for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python -m pagecli.attention.aot", __doc__.split("\n\n")[0],
                      "one row per target, kernel, dtype and head size instead of one per compile", argv)
    archs = targets(args)
    if archs is None:
        return 2
    cases = covering_sample() if args.sample else full_matrix()
    specs_per_arch = {arch: collect(cases, arch) for arch in archs}  # the launchers pick tiles per target
    specs = {spec: models for found in specs_per_arch.values() for spec, models in found.items()}
    if args.list:
        _print_list(specs, args.json)
        return 0
    results = [result for arch, found in specs_per_arch.items()
               for result in compile_all(found, [arch], max(1, args.jobs))]
    return report(results, len(specs), len(archs), args)


if __name__ == "__main__":
    sys.exit(main())
