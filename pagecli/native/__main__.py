"""`python -m pagecli.native`: compile (or load) the CPU kernels now and say where they are."""

from __future__ import annotations

import sys

from pagecli import native


def main() -> int:
    ops = native.cpu_ops(lambda message: print(f"==> {message}", flush=True))
    if ops is None:
        print(f"pagecli's CPU kernels are unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    bf16 = "with" if ops.has_bf16_linear() else "without"
    print(f"==> CPU kernels ready ({bf16} the AVX512-BF16 matmul) in {native.build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
