"""`python -m pagecli.native`: compile (or load) the CPU kernels now and say where they are."""

from __future__ import annotations

import sys

from pagecli import native
from pagecli.errors import PagecliError
from pagecli.native import isa


def main() -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
