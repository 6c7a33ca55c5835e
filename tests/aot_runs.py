"""Running the ahead-of-time checks (pagecli.attention.aot, aot_lora) as a user would, for the GPU-less tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_check(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` with Triton compiling (TRITON_INTERPRET, which the tests set, removed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def compiled_report(module: str, *args: str) -> list[dict[str, Any]]:
    """The results of a `--json` compile run; asserts none has a problem and the run exited 0."""
    run = run_check(module, *args, "--json")
    results = json.loads(run.stdout)["results"]
    problems = [f"sm_{r['arch']} {r['kernel']} {r['dtype']} {r['specialization']}: {'; '.join(r['problems'])}"
                for r in results if r["problems"]]
    assert problems == [], "\n".join(problems)
    assert run.returncode == 0, run.stderr[-2000:]
    return results
