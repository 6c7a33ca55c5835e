"""Start-up times of whole `pagecli` processes (issue 48), two source trees alternating, medians with the range.

    .venv/bin/python scripts/bench_start_time.py [--before DIR] [--runs 5] [--json OUT]

--before DIR: an export of an older commit (`git archive COMMIT | tar -x -C DIR`, then
`ln -s DIR/kernels DIR/pagecli/kernels`), run with PYTHONPATH=DIR; the other tree is the installed one.
Each command runs once first (not counted: bytecode written, the model converted, the kernels built), then
--runs times per tree, the trees alternating. What each figure is:

- `--help`, `generate --help`, `models`: the process from start to exit;
- `generate`: a one-line JSONL input, 16 tokens greedy, the output removed between runs, start to exit;
- `chat first token`: `echo Hi | pagecli chat -n 16 -t 0` from the start to the first byte of the reply on
  stdout (plain mode writes only the reply there);
- `serve /health`: `pagecli serve --port P` from the start to the first 200 from GET /health (polled every
  10 ms), then SIGTERM; `serve /health (any answer)`: to the first answer of any status (since the loading
  answers, a 503 `{"status": "loading"}` while the model loads; before them, the first 200);
- with --server-runs: the same `chat` and `generate` while a `pagecli serve --keep-alive 10m` of the same model
  runs: the newer tree finds it in the registry (plain `pagecli chat`), the older one is given `--server URL`;
  and `chat --server URL` (both trees) given 3 s to come up, then from writing the message to the reply's first byte.

Peak RSS and the process's CPU seconds (user + system: less at the mercy of a shared machine than the wall
time, though a busy core's caches still cost some) come from wait4. OMP_NUM_THREADS=1 unless --threads says otherwise (the machine is shared; see
docs/benchmarks/startup.md for why two threads on a busy 2-core machine measure the neighbours).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PYTHON = sys.executable


def env_for(tree: str | None, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["OMP_NUM_THREADS"] = str(threads)
    if tree:
        env["PYTHONPATH"] = tree
    return env


CPU_S: list[float] = []  # the CPU seconds (user + system) of each process reaped, in order


def wait_rss(process: subprocess.Popen) -> int:
    """Reap the process; its peak RSS in MiB (its CPU seconds go to CPU_S)."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    CPU_S.append(usage.ru_utime + usage.ru_stime)
    return usage.ru_maxrss // 1024


def run_whole(args: list[str], env: dict[str, str], stdin: bytes | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    process = subprocess.Popen([PYTHON, "-m", "pagecli", *args], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if stdin is not None:
        process.stdin.write(stdin)
    process.stdin.close()
    rss = wait_rss(process)
    elapsed = time.perf_counter() - start
    assert process.returncode == 0, f"pagecli {' '.join(args)} exited {process.returncode}"
    return elapsed, rss


def run_first_byte(args: list[str], env: dict[str, str], stdin: bytes,
                   settle_s: float | None = None) -> tuple[float, int]:
    """From the start to the reply's first byte on stdout; with settle_s, the client is left that long to come up
    and wait for its first line, and the time counts from writing `stdin` (what it wrote before is not counted)."""
    start = time.perf_counter()
    process = subprocess.Popen([PYTHON, "-m", "pagecli", *args], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if settle_s is not None:
        time.sleep(settle_s)
        assert process.poll() is None, f"pagecli {' '.join(args)} exited before the message"
        os.set_blocking(process.stdout.fileno(), False)
        while process.stdout.read(65536):  # what it wrote while coming up
            pass
        os.set_blocking(process.stdout.fileno(), True)
        start = time.perf_counter()
    process.stdin.write(stdin)
    process.stdin.flush()
    if settle_s is None:
        process.stdin.close()
    first = process.stdout.read(1)
    elapsed = time.perf_counter() - start
    assert first, f"pagecli {' '.join(args)} wrote nothing"
    if not process.stdin.closed:
        process.stdin.close()
    process.stdout.read()
    return elapsed, wait_rss(process)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def health_status(url: str) -> int | None:
    """GET url/health's status (503 while a server says "loading"), or None where nothing answers."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def healthy(url: str) -> bool:
    return health_status(url) == 200


def run_serve_health(env: dict[str, str], extra: list[str] = (), any_answer: bool = False) -> tuple[float, int]:
    port = free_port()
    start = time.perf_counter()
    process = subprocess.Popen([PYTHON, "-m", "pagecli", "serve", "--port", str(port), "--no-screen", *extra],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while (health_status(url) is None) if any_answer else not healthy(url):
        assert process.poll() is None, "the server exited"
        time.sleep(0.01)
    elapsed = time.perf_counter() - start
    process.send_signal(signal.SIGTERM)
    return elapsed, wait_rss(process)


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([PYTHON, "-m", "pagecli", "serve", "--port", str(port), "--no-screen",
                                "--keep-alive", "10m"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while not healthy(url):
        assert process.poll() is None, "the keep-alive server exited"
        time.sleep(0.05)
    return process, url


def summary(values: list[tuple[float, int, float]]) -> dict[str, object]:
    times = [t for t, _, _ in values]
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "peak_rss_mib": max(r for _, r, _ in values),
            "cpu_median_s": round(statistics.median(c for _, _, c in values), 3),
            "runs_s": [round(t, 3) for t in times]}


def timed(figure, env: dict[str, str], *extra: str) -> tuple[float, int, float]:
    """(wall seconds, peak RSS MiB, CPU seconds of the process: less at the mercy of a shared machine)."""
    elapsed, rss = figure(env, *extra)
    return elapsed, rss, CPU_S[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=None, help="an export of the older tree (PYTHONPATH)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None, help="figure names, separated by '+' (a name may hold a comma)")
    parser.add_argument("--server-runs", action="store_true", help="also chat and generate through a keep-alive server")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pagecli-start-"))
    if options.before:
        options.before = str(Path(options.before).resolve())
    # `python -m pagecli` puts the current folder first on sys.path, ahead of PYTHONPATH: run from the scratch
    # folder, or a run started in a checkout would time that checkout's pagecli for both trees.
    os.chdir(work)
    if options.json:
        options.json = str(Path(options.json).resolve())
    one_line = work / "one.jsonl"
    one_line.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    out = work / "one.out"

    def generate(env: dict[str, str], *extra: str) -> tuple[float, int]:
        out.unlink(missing_ok=True)
        return run_whole(["generate", str(one_line), "-o", str(out), "--max-tokens", "16", "--temperature", "0",
                          "--no-progress", *extra], env)

    figures = {
        "--help": lambda env: run_whole(["--help"], env),
        "generate --help": lambda env: run_whole(["generate", "--help"], env),
        "models": lambda env: run_whole(["models"], env),
        "generate 1 line, 16 tokens": generate,
        "chat first token": lambda env: run_first_byte(["chat", "-n", "16", "-t", "0"], env, b"Hi\n"),
        "serve /health": run_serve_health,
        "serve /health (any answer)": lambda env: run_serve_health(env, any_answer=True),
    }
    if options.only:
        figures = {name: fn for name, fn in figures.items() if name in options.only.split("+")}
    trees = {"before": options.before, "after": None} if options.before else {"after": None}
    for tree, path in trees.items():  # which pagecli each tree's processes import, said before any figure
        where = subprocess.run([PYTHON, "-c", "import pagecli; print(pagecli.__file__)"], env=env_for(path, 1),
                               capture_output=True, text=True, check=True).stdout.strip()
        print(f"{tree}: {where}", flush=True)
    results: dict[str, dict[str, object]] = {}
    for name, figure in figures.items():
        runs: dict[str, list[tuple[float, int, float]]] = {tree: [] for tree in trees}
        for tree, path in trees.items():
            figure(env_for(path, options.threads))  # the first run: not counted
        for _ in range(options.runs):
            for tree, path in trees.items():
                runs[tree].append(timed(figure, env_for(path, options.threads)))
        results[name] = {tree: summary(values) for tree, values in runs.items()}
        print(name, json.dumps(results[name]), flush=True)

    if options.server_runs:
        server, url = start_server(env_for(None, options.threads))
        try:
            for name, args in (("chat first token, a server running", ["chat", "-n", "16", "-t", "0"]),
                               ("chat first token after the message, a server running", "after"),
                               ("generate 1 line, a server running", None)):
                runs = {tree: [] for tree in trees}
                for _ in range(options.runs + 1):
                    for tree, path in trees.items():
                        extra = ["--server", url] if tree == "before" else []
                        env = env_for(path, options.threads)
                        if args is None:
                            runs[tree].append(timed(generate, env, *extra))
                        elif args == "after":
                            chat = ["chat", "-n", "16", "-t", "0", "--server", url]
                            runs[tree].append(timed(lambda e, *x: run_first_byte(chat, e, b"Hi\n", settle_s=3.0), env))
                        else:
                            runs[tree].append(timed(lambda e, *x: run_first_byte([*args, *x], e, b"Hi\n"), env, *extra))
                results[name] = {tree: summary(values[1:]) for tree, values in runs.items()}
                print(name, json.dumps(results[name]), flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
