"""A long chat in one process: `pagecli chat --jsonl` for 300 turns with short replies.

    .venv/bin/python scripts/bench_chat_soak.py [--turns 300] [--max-tokens 16] [-- extra chat options]

Runs the real CLI (plain JSONL mode, the embedded SmolLM2-135M-Instruct, default settings) as a
child process, writes one user message at a time and waits for its record, so the child is idle
when its memory is read (VmRSS and its peak VmHWM, from /proc). Reports, at turns 1, 10, 100,
the last but one and the last: RSS, the pool (blocks active / cached / free), the turn's TTFT,
prompt and prefilled tokens. Also the turns where the conversation outgrew max_model_len and
the oldest turns were dropped (those re-prefill the rest), and the median TTFT of the other
turns per 50. The disk prefix store goes to a temp directory (removed afterwards) unless
PAGECLI_CACHE_DIR is set. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
TOPICS = [
    "the tides", "bread yeast", "rainbows", "compound interest", "the Roman roads", "bees", "glaciers",
    "the printing press", "volcanoes", "chess openings", "coffee roasting", "solar eclipses", "the Silk Road",
    "paper folding", "lighthouses", "migrating birds", "the first telescopes", "sourdough", "bridges", "comets",
]
QUESTIONS = ["Tell me one fact about {}.", "Why do people find {} interesting?", "How would you explain {} to a child?"]
REPORT_TURNS = (1, 10, 100)
WINDOW_TURNS = 50


def message(turn: int) -> str:
    topic = TOPICS[turn % len(TOPICS)]
    return f"Turn {turn}. " + QUESTIONS[turn // len(TOPICS) % len(QUESTIONS)].format(topic)


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and its peak so far (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "peak_rss_mib": round(int(fields["VmHWM"].split()[0]) / 1024, 1)}


def read_record(child: subprocess.Popen) -> dict:
    """The next turn record; error records and stderr notices do not count as turns."""
    while True:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"pagecli chat exited early with code {child.wait()}")
        record = json.loads(line)
        if "turn" in record:
            return record
        print(f"  non-turn record: {record}", file=sys.stderr)


def ttft_ms(record: dict) -> float:
    return round((record["ttft_s"] or 0.0) * 1000, 1)


def row(turn: int, record: dict, memory: dict[str, float]) -> dict:
    stats = record["stats"]
    return {
        "turn": turn, **memory, "ttft_ms": ttft_ms(record), "dropped_turns": record["dropped_turns"],
        "prompt_tokens": record["prompt_tokens"], "prefilled_tokens": record["prefilled_tokens"],
        "cached_tokens": record["cached_tokens"], "blocks_active": stats["blocks_active"],
        "blocks_cached": stats["blocks_cached"], "blocks_free": stats["blocks_free"],
        "num_blocks": stats["num_blocks"],
    }


def soak(turns: int, max_tokens: int, extra: list[str], env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "pagecli", "chat", "--jsonl", "--system", SYSTEM, "--max-tokens", str(max_tokens),
               "--temperature", "0", *extra]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1)
    rows, truncations, windows, window = [], [], [], []
    try:
        for turn in range(1, turns + 1):
            child.stdin.write(message(turn) + "\n")
            child.stdin.flush()
            record = read_record(child)
            if record["dropped_turns"]:
                truncations.append({"turn": turn, "dropped_turns": record["dropped_turns"],
                                    "prefilled_tokens": record["prefilled_tokens"], "ttft_ms": ttft_ms(record)})
            else:
                window.append(ttft_ms(record))
            if turn % WINDOW_TURNS == 0 or turn == turns:
                windows.append({"turns": f"{(turn - 1) // WINDOW_TURNS * WINDOW_TURNS + 1}-{turn}",
                                "ttft_ms_median": sorted(window)[len(window) // 2] if window else None})
                window = []
            if turn in REPORT_TURNS or turn >= turns - 1:
                rows.append(row(turn, record, memory_mib(child.pid)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        child.stdin.close()
        code = child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    return {
        "command": " ".join(command[1:]), "turns": turns, "exit_code": code,
        "wall_s": round(time.perf_counter() - started, 1), "rows": rows, "truncations": truncations,
        "ttft_ms_median_per_50_turns_without_truncation": windows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("extra", nargs="*", help="more `pagecli chat` options, after --")
    args = ap.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="pagecli-soak-") as store:
        env.setdefault("PAGECLI_CACHE_DIR", store)
        result = soak(args.turns, args.max_tokens, args.extra, env)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
