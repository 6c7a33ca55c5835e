"""N concurrent streaming clients against `pagecli serve` over the batch workload (`bench run mixed`, or
`--workload shared-prefix`: one long system prompt, short questions): output tokens/s, TTFT p50/p99
and inter-token latency p50/p99, for each client count.

    .venv/bin/python scripts/bench_serve.py [--model M] [--clients 1,8,64] [--count 64] [--max-tokens 32]
        [--workload mixed|shared-prefix] [--dtype float32] [--threads N] [--offline] [--url URL]

Without --url the script starts `pagecli serve` itself (on a free port, with --ignore-eos so every
request generates its workload length) and stops it with SIGTERM. Each client sends one request at
a time, taking the next from the shared workload until none is left. Each client count gets prompts of
its own (workload seed = its position), so no pass finds an earlier pass's prompts in the prefix cache.
Tokens are counted from each stream's usage chunk; TTFT and inter-token gaps are timed at the client
from chunks with text. --offline also runs the last pass's prompts through Engine.generate in a fresh
engine in this process (disk store off: cold, like the served pass), for the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagecli.bench.workloads import BenchRequest, builtin_workload
from pagecli.config import SamplingParams


@dataclass
class Timing:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def request_body(request: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
              "max_tokens": request.sampling.max_tokens}
    if isinstance(request.prompt, str):
        return "/v1/completions", {**common, "prompt": request.prompt}
    return "/v1/chat/completions", {**common, "messages": list(request.prompt)}


def chunk_text(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def timed_request(http: httpx.AsyncClient, request: BenchRequest, model: str) -> Timing:
    path, body = request_body(request, model)
    start, last, timing = time.perf_counter(), None, None
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise SystemExit(f"{path} answered {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if data.get("usage") and timing is not None:
                timing.tokens = data["usage"]["completion_tokens"]
            elif data.get("choices") and chunk_text(data):
                if timing is None:
                    timing = Timing(now - start)
                else:
                    timing.gaps_s.append(now - last)  # type: ignore[operator]
                last = now
    assert timing is not None, "a stream ended without text"
    return timing


async def run_clients(url: str, model: str, requests: list[BenchRequest], clients: int) -> tuple[list[Timing], float]:
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    timings: list[Timing] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await timed_request(http, queue.get_nowait(), model))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return timings, time.perf_counter() - start


def summary(clients: int, timings: list[Timing], elapsed_s: float) -> dict[str, Any]:
    tokens = sum(t.tokens for t in timings)
    ttfts = [t.ttft_s for t in timings]
    gaps = [g for t in timings for g in t.gaps_s]
    return {"clients": clients, "requests": len(timings), "output_tokens": tokens, "elapsed_s": round(elapsed_s, 3),
            "output_tok_per_s": round(tokens / elapsed_s, 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
            "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2), "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2)}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "pagecli", "serve", "--port", "0", "--no-screen", "--ignore-eos",
               "--max-pending", "100000", "--dtype", args.dtype]
    command += [args.model] if args.model else []
    command += ["--threads", str(args.threads)] if args.threads else []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:  # type: ignore[union-attr]
        match = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if match:
            # The per-request log lines must keep flowing, or the server blocks on a full pipe.
            threading.Thread(target=process.stdout.read, daemon=True).start()  # type: ignore[union-attr]
            return process, match.group(1)
        print(line, end="", file=sys.stderr)
    raise SystemExit("the server did not start")


def offline_tok_per_s(args: argparse.Namespace, requests: list[BenchRequest]) -> float:
    from pagecli.config import EngineConfig
    from pagecli.engine import Engine

    engine = Engine(args.model, EngineConfig(dtype=args.dtype, threads=args.threads, disk_cache=False))
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request.prompt if isinstance(request.prompt, str) else list(request.prompt),
                           request.sampling)
    tokens = sum(len(event.token_ids) for event in engine.stream())
    elapsed_s = time.perf_counter() - start
    engine.close()
    return tokens / elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model for the server (default: the embedded one)")
    parser.add_argument("--url", default=None, help="a running server instead of starting one")
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--count", type=int, default=64, help="requests per client count")
    parser.add_argument("--workload", default="mixed", choices=("mixed", "shared-prefix"))
    parser.add_argument("--max-tokens", type=int, default=None, help="every output length (default: workload's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--offline", action="store_true", help="also time Engine.generate on the same prompts")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    process, url = (None, args.url) if args.url else start_server(args)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows = []
        for seed, clients in enumerate(int(c) for c in args.clients.split(",")):
            workload = builtin_workload(args.workload, SamplingParams(temperature=0), args.count, args.max_tokens,
                                        seed)
            requests = list(workload.requests)
            timings, elapsed = asyncio.run(run_clients(url, model, requests, clients))
            rows.append(summary(clients, timings, elapsed))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    if args.offline:
        rate = offline_tok_per_s(args, requests)
        print(json.dumps({"offline_generate_tok_per_s": round(rate, 1), "clients": rows[-1]["clients"],
                          "serve_vs_offline": round(rows[-1]["output_tok_per_s"] / rate, 2)}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
