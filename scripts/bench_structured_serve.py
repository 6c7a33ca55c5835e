"""Issue 25's side-by-side: the batch workload (64 chat prompts of 39..596 tokens, 128 tokens each) sent at
once to OpenAI-compatible servers, every request with bench_structured.py's JSON schema
(`response_format: json_schema`) and, in the same round, without one: output tok/s of each pass and the
constrained / unconstrained ratio of each server.

    .venv/bin/python scripts/bench_structured_serve.py [--reps 3] [--prompts 64] [--max-tokens 128] [--threads 2]
        [--peer vllm=http://127.0.0.1:8001] [--peer llama-server=http://127.0.0.1:8002] [--no-pagecli]

pagecli serve is started here (the embedded model, --ignore-eos, on a free port) unless --no-pagecli; peers
are servers you started (docs/BENCHMARKS.md has the commands used), named and reached by --peer NAME=URL.
Each request is a plain (not streamed) chat completion, greedy, max_tokens as given; unconstrained ones carry
`ignore_eos: true` (a field vLLM and llama-server read; pagecli serve takes it from its flag). Constrained ones
do not: llama-server fails a request (HTTP 500, "Unexpected empty grammar stack") whose grammar is complete
while EOS is banned. The schema asks for at least 8 list items, more than 128 tokens hold, so constrained
replies run about as long as unconstrained ones; a reply that closes its JSON early counts the tokens it has
(the servers' own usage.completion_tokens, which the figures are computed from). Each pass's messages start with a set number of their own, so no pass
finds an earlier one's prompts in a server's prefix cache (every pass prefills, as bench_structured.py's do);
the servers get the same messages in the same pass. Rounds alternate servers and modes (none, schema), so a
slower minute of the machine hits every contender; medians and ranges over --reps rounds are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import batch_messages  # noqa: E402
from bench_structured import SCHEMA  # noqa: E402
from serve_peers import start_pagecli  # noqa: E402

from pagecli.models.source import prepare_default_model  # noqa: E402

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA, "strict": True}}


async def one_pass(url: str, model: str, messages: list[str], constrained: bool, max_tokens: int) -> dict:
    """Every message at once; output tokens/s over the pass, and the replies' finish reasons."""
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=len(messages))) as http:

        async def ask(text: str) -> dict:
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0}
            if constrained:
                body["response_format"] = RESPONSE_FORMAT
            else:
                body["ignore_eos"] = True
            response = await http.post("/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise SystemExit(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
            return response.json()

        start = time.perf_counter()
        replies = await asyncio.gather(*(ask(text) for text in messages))
        seconds = time.perf_counter() - start
    tokens = sum(reply["usage"]["completion_tokens"] for reply in replies)
    texts = [reply["choices"][0]["message"].get("content") or "" for reply in replies]
    return {"tok_s": tokens / seconds, "tokens": tokens,
            "json_starts": sum(text.lstrip().startswith("{") for text in texts),
            "finish": sorted({reply["choices"][0]["finish_reason"] for reply in replies})}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=64, help="the first N of the 64 prompts")
    parser.add_argument("--threads", type=int, default=2, help="pagecli serve's threads")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=URL", help="a running server")
    parser.add_argument("--no-pagecli", action="store_true", help="leave pagecli serve out")
    args = parser.parse_args()
    servers: dict[str, str] = {}
    process = None
    if not args.no_pagecli:
        process, servers["pagecli"] = start_pagecli(None, "auto", args.threads)
    for peer in args.peer:
        name, _, url = peer.partition("=")
        if not url:
            raise SystemExit(f"--peer {peer!r}: give NAME=URL")
        servers[name] = url.rstrip("/")
    if not servers:
        raise SystemExit("nothing to run: give --peer NAME=URL or leave pagecli in")
    messages = batch_messages(str(prepare_default_model()))[: args.prompts]
    results: dict[tuple[str, bool], list[dict]] = {}
    try:
        models = {name: httpx.get(url + "/v1/models").json()["data"][0]["id"] for name, url in servers.items()}
        for name, url in servers.items():  # warm-up: first-call costs, grammar compilers
            asyncio.run(one_pass(url, models[name], messages[:2], True, 8))
        for r in range(args.reps):
            for name, url in servers.items():
                for constrained in (False, True):
                    fresh = [f"Set {2 * r + constrained}. {text}" for text in messages]  # no prefix-cache hits
                    row = asyncio.run(one_pass(url, models[name], fresh, constrained, args.max_tokens))
                    results.setdefault((name, constrained), []).append(row)
                    print(f"round {r + 1} {name} {'json_schema' if constrained else 'none'}: {row['tok_s']:.1f} tok/s "
                          f"({row['tokens']} tokens, {row['json_starts']} replies start with '{{', "
                          f"finish {','.join(row['finish'])})", flush=True)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    print(f"\n{len(messages)} prompts x {args.max_tokens} tokens, all at once, medians [ranges] of {args.reps} rounds:")
    for name in servers:
        plain = [row["tok_s"] for row in results[(name, False)]]
        schema = [row["tok_s"] for row in results[(name, True)]]
        pairs = " ".join(f"{s / p:.2f}" for s, p in zip(schema, plain))
        print(f"  {name}: none {spread(plain)} tok/s, json_schema {spread(schema)} tok/s, ratio of medians "
              f"{statistics.median(schema) / statistics.median(plain):.2f} (rounds {pairs})")


if __name__ == "__main__":
    main()
