"""Time to first token with the disk prefix store: cold, warm from disk (new process), warm from memory.

The prompt is a ~1,500-token system prompt plus a short question, with the embedded SmolLM2 model.
Each phase runs in a fresh process on one store directory:

    python scripts/bench_prefix_store.py                 # all phases, 3 rounds, a temp store
    python scripts/bench_prefix_store.py --rounds 5 --cache-dir /tmp/store

Prints one JSON line per phase run and a summary (median TTFT per phase, write cost, bytes on disk
per 1,000 cached tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM_TOKENS = 1500
QUESTIONS = ("What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?")
_PARAGRAPH = (
    "You are a careful assistant for a library that lends books, maps, music and films. Answer briefly and "
    "politely. Opening hours are nine to six on weekdays and ten to four on Saturdays; the library is closed on "
    "Sundays and public holidays. Members may borrow up to {n} items for three weeks and renew them twice online. "
    "Rule {n}: late items cost ten cents a day, capped at the item's price. "
)


def system_prompt(tokenizer, num_tokens: int) -> str:
    text, n = "", 0
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        n += 1
        text += _PARAGRAPH.format(n=n)
    ids = tokenizer(text)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def run_phase(phase: str) -> dict:
    """One process: cold (persist afterwards), or disk then memory."""
    from pagecli.config import EngineConfig, SamplingParams
    from pagecli.engine import Engine

    engine = Engine(None, EngineConfig())
    sampling = SamplingParams(temperature=0, max_tokens=1)
    system = system_prompt(engine.tokenizer, SYSTEM_TOKENS)
    engine.generate(["Warm up: say hello."], sampling)  # first-call costs are not what is measured
    results = []
    for question in (QUESTIONS[0],) if phase == "cold" else QUESTIONS[1:]:
        before = engine.stats()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = engine.encode(messages)
        out = engine.generate([ids], sampling)[0]
        now = engine.stats()
        results.append({
            "tier": "cold" if phase == "cold" else ("disk" if now.prefix_disk_hit_tokens > before.prefix_disk_hit_tokens
                                                    else "memory"),
            "prompt_tokens": len(ids), "ttft_s": out.ttft_s,
            "memory_hit_tokens": now.prefix_hit_tokens - before.prefix_hit_tokens,
            "disk_hit_tokens": now.prefix_disk_hit_tokens - before.prefix_disk_hit_tokens,
            "prefilled_tokens": now.prompt_tokens_computed - before.prompt_tokens_computed,
        })
    record: dict = {"phase": phase, "runs": results}
    if phase == "cold":
        system_ids = engine.encode([{"role": "system", "content": system}])
        start = time.perf_counter()
        queued = engine.persist_prefix(ids)
        record["persist_call_s"] = time.perf_counter() - start  # engine thread: walk + copy out of the pool
        start = time.perf_counter()
        engine.flush_disk_writes()
        record["background_write_s"] = time.perf_counter() - start  # writer thread: serialize, checksum, write
        record["blocks_written"] = queued
        record["tokens_written"] = queued * engine.config.block_size
        record["bytes_written"] = engine.disk.store.bytes_written if engine.disk else 0
        record["system_tokens"] = len(system_ids)
    record["warnings"] = engine.take_warnings()
    engine.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--phase", choices=("cold", "warm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase)))
        return
    records = []
    for _ in range(args.rounds):
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pagecli-prefix-bench-")
        env = {**os.environ, "PAGECLI_CACHE_DIR": cache_dir}
        if args.cache_dir:
            from pagecli.store.maintenance import clear

            clear(Path(cache_dir), None, [])  # every round starts cold
        for phase in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--phase", phase], env=env, check=True,
                                 capture_output=True, text=True).stdout
            record = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(record))
            records.append(record)
    ttft = {tier: [r["ttft_s"] for rec in records for r in rec["runs"] if r["tier"] == tier]
            for tier in ("cold", "disk", "memory")}
    cold = [rec for rec in records if rec["phase"] == "cold"]
    summary = {tier: round(statistics.median(v) * 1000, 1) for tier, v in ttft.items() if v}
    summary["persist_call_ms"] = round(statistics.median(r["persist_call_s"] for r in cold) * 1000, 1)
    summary["background_write_ms"] = round(statistics.median(r["background_write_s"] for r in cold) * 1000, 1)
    summary["bytes_per_1000_tokens"] = round(cold[0]["bytes_written"] / cold[0]["tokens_written"] * 1000)
    print("median TTFT (ms) and write cost:", json.dumps(summary))


if __name__ == "__main__":
    main()
