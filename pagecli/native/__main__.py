"""`python -m pagecli.native [--bandwidth]`: compile (or load) the CPU kernels now and say where they are
and how they would keep a model's weights (the weight plan); with --bandwidth, also the memory's read
bandwidth on torch's threads (a plain read loop, the ceiling that single-stream decode approaches).
A command, so it sits in the top layer of tests/test_import_layers.py, beside the CLI."""

from __future__ import annotations

import statistics
import sys

from pagecli import native
from pagecli.errors import PagecliError
from pagecli.native import isa
from pagecli.native.interface import CpuOps


def main(argv: list[str] | None = None) -> int:
    """The command with `argv` (none: no options; `python -m` passes the command line's)."""
    args = argv or []
    if any(arg not in ("--bandwidth",) for arg in args):
        print(f"usage: python -m pagecli.native [--bandwidth]\n{__doc__}", file=sys.stderr)
        return 2
    try:
        native.level()
    except PagecliError as exc:
        print(f"pagecli: {exc}", file=sys.stderr)
        return 2
    ops = native.cpu_ops(lambda message: print(f"==> {message}", flush=True))
    if ops is None:
        print(f"pagecli's CPU kernels are unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    if ops.has_amx():
        bf16 = "bf16 products, prefill and decode attention on AMX tiles"
    elif ops.has_bf16_linear():
        bf16 = "with the AVX512-BF16 matmul"
    else:
        bf16 = "without the AVX512-BF16 matmul"
    levels = isa.machine_levels(native.cpu_flags())
    print(f"==> CPU kernels ready: level {native.level()} of {', '.join(levels)} ({bf16}; "
          f"{isa.ENV_VAR} forces a lower level) in {native.build_dir()}")
    print(f"==> --quantize products: {quantized_kernels(ops)}")
    for dtype_name in ("float32", "bfloat16"):
        print(f"==> a {dtype_name} model's weights: {weight_forms(ops, dtype_name)}")
    print(f"==> weights: {native.weight_pages()}")
    if "--bandwidth" in args:
        import torch

        from pagecli.native.bandwidth import DEFAULT_MIB, read_bandwidth

        rates = read_bandwidth(ops)
        print(f"==> read bandwidth, {torch.get_num_threads()} threads, {DEFAULT_MIB} MiB read {len(rates)} times: "
              f"{statistics.median(rates):.1f} GB/s [{min(rates):.1f}-{max(rates):.1f}]")
    return 0


def quantized_kernels(ops: CpuOps) -> str:
    """Which kernels run --quantize int8 and int4 (and gguf's blocks) at this level, in words."""
    kinds = {"int8": ops.int8_linear_kind(), "int4": ops.int4_linear_kind()}
    named = ", ".join(f"{name} on {kind or 'the PyTorch reference'}" for name, kind in kinds.items())
    if "avx512_vnni" in kinds.values():
        named += (" (AVX512-VNNI: bf16/fp16 models' activations rounded to int8 in blocks of 64; float32 "
                  "models' to int16: int4 products on VNNI as two int8 halves, int8 ones on the avx2 kernels)")
    elif "avx2" in kinds.values():
        named += " (activations rounded to int16 in blocks of 64, multiplied with vpmaddwd)"
    return named


def weight_forms(ops: CpuOps, dtype_name: str) -> str:
    """The weight plan (pagecli.models.weight_plan) of a model of this dtype at this level, --quantize none."""
    import torch

    from pagecli.models.weight_plan import plan_weights

    plan = plan_weights(getattr(torch, dtype_name), torch.device("cpu"), "none", ops)
    return plan.describe()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
