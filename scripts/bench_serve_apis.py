"""N concurrent clients against one `pagecli serve`, their requests mixed across the four APIs (Chat Completions,
Responses, Anthropic Messages, Ollama chat; every other request streamed), against the same requests sent to
Chat Completions alone: every request must be answered (200, the full max_tokens, no error), and the output
tokens/s of the two passes are compared.

    .venv/bin/python scripts/bench_serve_apis.py [--clients 64] [--requests 256] [--max-tokens 32] [--reps 3]
        [--model FOLDER] [--threads N] [--url URL] [--passes mixed,chat] [--json FILE]

The server is started here (`pagecli serve --ignore-eos --no-disk-cache`, serve_peers.start_pagecli), so
every request runs exactly --max-tokens greedy tokens; --url drives one started elsewhere with --ignore-eos.
A repetition runs the mixed pass and the Chat-Completions-only pass, alternating which goes first, each on
prompts of its own (no pass finds another's prompts in the prefix cache). One JSON row per pass goes to stdout,
then the medians with [min-max] and the ratio mixed / chat. `--passes chat` runs Chat Completions alone (a
server without the other APIs, for a before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

APIS = ("chat", "responses", "messages", "ollama")
SYSTEM = "You are a helpful assistant who answers in a few sentences."
TOPICS = ("paged attention", "prefix caching", "continuous batching", "the block pool", "chunked prefill",
          "speculative decoding", "grammar-constrained decoding", "tool calling", "KV quantization", "preemption")


@dataclass(frozen=True)
class Ask:
    number: int
    api: str
    stream: bool
    messages: tuple[dict[str, str], ...]


@dataclass
class Answer:
    number: int
    api: str
    stream: bool
    status: int
    text: str
    output_tokens: int
    error: str | None = None


def asks(count: int, seed: int, mixed: bool) -> list[Ask]:
    """`count` requests with prompts of their own (seed: the pass), spread over the APIs when mixed."""
    out = []
    for number in range(count):
        topic = TOPICS[(number + seed) % len(TOPICS)]
        user = f"Question {seed}-{number}: explain {topic} to a new engineer, step by step."
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": user})
        out.append(Ask(number, APIS[number % 4] if mixed else "chat", (number // 4) % 2 == 1, messages))
    return out


def request_of(ask: Ask, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    system, user = ask.messages
    if ask.api == "chat":
        return "/v1/chat/completions", {"model": model, "messages": list(ask.messages), "max_tokens": max_tokens,
                                        "temperature": 0, "stream": ask.stream,
                                        **({"stream_options": {"include_usage": True}} if ask.stream else {})}
    if ask.api == "responses":
        return "/v1/responses", {"model": model, "instructions": system["content"], "input": user["content"],
                                 "max_output_tokens": max_tokens, "temperature": 0, "stream": ask.stream}
    if ask.api == "messages":
        return "/v1/messages", {"model": model, "system": system["content"], "messages": [user],
                                "max_tokens": max_tokens, "temperature": 0, "stream": ask.stream}
    return "/api/chat", {"model": model, "messages": list(ask.messages), "stream": ask.stream,
                         "options": {"temperature": 0, "num_predict": max_tokens}}


def read_whole(api: str, body: dict[str, Any]) -> tuple[str, int]:
    """The reply's text and output tokens from a non-streamed body."""
    if api == "chat":
        return body["choices"][0]["message"]["content"] or "", body["usage"]["completion_tokens"]
    if api == "responses":
        text = "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])
        return text, body["usage"]["output_tokens"]
    if api == "messages":
        return "".join(b.get("text", "") for b in body["content"]), body["usage"]["output_tokens"]
    return body["message"]["content"], body["eval_count"]


def read_event(api: str, data: dict[str, Any], text: list[str]) -> int | None:
    """Adds a streamed event's text to `text`; the output token count where the event carries the final one."""
    if api == "chat":
        for choice in data.get("choices", ()):
            text.append(choice["delta"].get("content") or "")
        return data["usage"]["completion_tokens"] if data.get("usage") else None
    if api == "responses":
        if data["type"] == "response.output_text.delta":
            text.append(data["delta"])
        ended = data["type"] in ("response.completed", "response.incomplete")  # incomplete: max_output_tokens
        return data["response"]["usage"]["output_tokens"] if ended else None
    if api == "messages":
        if data["type"] == "content_block_delta" and data["delta"]["type"] == "text_delta":
            text.append(data["delta"]["text"])
        return data["usage"]["output_tokens"] if data["type"] == "message_delta" else None
    text.append(data["message"]["content"])
    return data["eval_count"] if data.get("done") else None


async def send(http: httpx.AsyncClient, ask: Ask, model: str, max_tokens: int) -> Answer:
    path, body = request_of(ask, model, max_tokens)
    try:
        if not ask.stream:
            response = await http.post(path, json=body)
            if response.status_code != 200:
                return Answer(ask.number, ask.api, False, response.status_code, "", 0, response.text[:200])
            text, tokens = read_whole(ask.api, response.json())
            return Answer(ask.number, ask.api, False, 200, text, tokens)
        parts: list[str] = []
        tokens = 0
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return Answer(ask.number, ask.api, True, response.status_code, "", 0, (await response.aread())[:200])
            async for line in response.aiter_lines():
                payload = line[len("data: "):] if line.startswith("data: ") else line if ask.api == "ollama" else ""
                if not payload or payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data or data.get("type") == "error":
                    return Answer(ask.number, ask.api, True, 200, "", 0, str(data["error"])[:200])
                tokens = read_event(ask.api, data, parts) or tokens
        return Answer(ask.number, ask.api, True, 200, "".join(parts), tokens)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Answer(ask.number, ask.api, ask.stream, 0, "", 0, f"{type(exc).__name__}: {exc}")


async def run_pass(url: str, model: str, requests: list[Ask], clients: int, max_tokens: int,
                   headers: dict[str, str] | None = None) -> tuple[list[Answer], float]:
    """Every request answered by `clients` concurrent clients; the answers (by number) and the wall time."""
    queue = list(reversed(requests))
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers) as http:
        async def client() -> None:
            while queue:
                answers.append(await send(http, queue.pop(), model, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed_s = time.perf_counter() - start
    return sorted(answers, key=lambda a: a.number), elapsed_s


def row(name: str, rep: int, answers: list[Answer], elapsed_s: float, max_tokens: int) -> dict[str, Any]:
    failed = [a for a in answers if a.status != 200 or a.error or a.output_tokens != max_tokens]
    tokens = sum(a.output_tokens for a in answers)
    return {"pass": name, "rep": rep, "requests": len(answers), "failed": len(failed),
            "first_failure": asdict(failed[0]) if failed else None, "output_tokens": tokens,
            "elapsed_s": round(elapsed_s, 3), "output_tok_per_s": round(tokens / elapsed_s, 1),
            "by_api": {api: sum(1 for a in answers if a.api == api) for api in APIS}}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256, help="requests per pass")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--url", default=None, help="a running `pagecli serve --ignore-eos` instead of starting one")
    parser.add_argument("--passes", default="mixed,chat", help="which passes: mixed, chat or both")
    parser.add_argument("--json", default=None, help="write the rows here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    process = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_peers import start_pagecli

        process, url = start_pagecli(args.model, "auto", args.threads, ["--no-disk-cache"])
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        passes = args.passes.split(",")
        asyncio.run(run_pass(url, model, asks(4, 999, "mixed" in passes), 4, 4))  # warm-up, untimed
        rows = []
        for rep in range(args.reps):
            order = ("mixed", "chat") if rep % 2 == 0 else ("chat", "mixed")
            for name in (name for name in order if name in passes):
                seed = 2 * rep + (name == "mixed")
                requests = asks(args.requests, seed, mixed=name == "mixed")
                answers, elapsed_s = asyncio.run(run_pass(url, model, requests, args.clients, args.max_tokens))
                rows.append(row(name, rep, answers, elapsed_s, args.max_tokens))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    mixed = [r["output_tok_per_s"] for r in rows if r["pass"] == "mixed"]
    chat = [r["output_tok_per_s"] for r in rows if r["pass"] == "chat"]
    failed = sum(r["failed"] for r in rows)
    print(f"{args.clients} clients, {args.requests} requests a pass, {args.max_tokens} tokens each, {args.reps} reps")
    if mixed:
        print(f"  four APIs mixed        {spread(mixed)} output tok/s")
    if chat:
        print(f"  Chat Completions alone {spread(chat)} output tok/s")
    if mixed and chat:
        print(f"  mixed / chat           {statistics.median(mixed) / statistics.median(chat):.3f}")
    print(f"  failed requests        {failed}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
