"""llama.cpp's speculative decoding on bench_speculation.py's workloads (issue 50's peer): llama-server on
the embedded model's own GGUF file, one request at a time, greedy, for each of its n-gram speculation
types and draft lengths, and without speculation.

    LLAMA_SERVER=.../llama-server .venv/bin/python scripts/bench_speculation_llama.py [--threads 1]
        [--workload edit|open] [--configs none,ngram-simple:8,ngram-map-k:8,...] [--reps 2] [--max-tokens 256]

Each configuration is one server started with `--spec-type TYPE --spec-draft-n-max N` (and the n-gram
types' draft length, size-m, set to N), -t THREADS, one slot. The requests are the chat-templated
prompt token ids bench_speculation.py sends pagecli (so both models read the same tokens), temperature
0 with top_k 1, n_predict --max-tokens, prompt caching on (as pagecli's prefix cache is). Prints per
configuration the drafts accepted (the server's timings), the median over --reps of the set's decode rate (its tokens over the server's own
decode time, `timings.predicted_ms`: prefill left out, which favours llama.cpp against pagecli's
figure that includes whatever prefill its cache left), and its end-to-end rate (tokens over prompt
plus decode time), and how many outputs differ from llama.cpp's own without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from bench_speculation import SET, open_prompts

from pagecli.doctor import cpu_model
from pagecli.models.source import default_model_gguf

SERVER = os.environ.get("LLAMA_SERVER", "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")
NGRAM_LENGTH_FLAG = {"ngram-simple": "--spec-ngram-simple-size-m", "ngram-map-k": "--spec-ngram-map-k-size-m",
                     "ngram-map-k4v": "--spec-ngram-map-k4v-size-m"}


def prompts_for(workload: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from pagecli.models.source import resolve_model
    hf = AutoTokenizer.from_pretrained(resolve_model(None))

    class Tokenizer:  # pagecli's tokenizer's two calls: the template as text, then its ids
        encode = staticmethod(hf.encode)

        @staticmethod
        def apply_chat_template(messages, add_generation_prompt):
            return hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    tokenizer = Tokenizer()
    if workload == "open":
        return open_prompts(tokenizer)
    requests = [json.loads(line) for line in SET.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True),
                             add_special_tokens=False) for r in requests]


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def start_server(config: str, threads: int, port: int) -> subprocess.Popen:
    kind, _, n = config.partition(":")
    args = [SERVER, "-m", str(default_model_gguf()), "-t", str(threads), "-tb", str(threads), "--port", str(port),
            "-c", "4096", "-np", "1"]
    if kind != "none":
        args += ["--spec-type", kind, "--spec-draft-n-max", n]
        if kind in NGRAM_LENGTH_FLAG:
            args += [NGRAM_LENGTH_FLAG[kind], n]
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(SERVER).parent))
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"llama-server did not start for {config}")


def run_set(port: int, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]], str]:
    tokens, decode_ms, prompt_ms, outputs = 0, 0.0, 0.0, []
    drafted = accepted = 0
    for prompt in prompts:
        reply = post(port, {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                            "cache_prompt": True, "return_tokens": True, "samplers": ["top_k"]})
        timings = reply["timings"]
        tokens += timings["predicted_n"]
        decode_ms += timings["predicted_ms"]
        prompt_ms += timings["prompt_ms"]
        drafted += timings.get("draft_n", 0)
        accepted += timings.get("draft_n_accepted", 0)
        outputs.append(reply.get("tokens", []))
    drafts = f"{accepted} of {drafted} drafts accepted" if drafted else "no drafts"
    return tokens / decode_ms * 1e3, tokens / (decode_ms + prompt_ms) * 1e3, outputs, drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workload", choices=("edit", "open"), default="edit")
    ap.add_argument("--configs", default="none,ngram-simple:4,ngram-simple:8,ngram-simple:16,ngram-map-k:8,"
                                         "ngram-mod:8,ngram-cache:8")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--port", type=int, default=18650)
    args = ap.parse_args()
    prompts = prompts_for(args.workload)
    print(f"CPU: {cpu_model()}; llama-server {args.threads} threads; {len(prompts)} {args.workload} requests, "
          f"greedy, max_tokens {args.max_tokens}; load {os.getloadavg()[0]:.2f}", flush=True)
    reference: list[list[int]] | None = None
    for config in args.configs.split(","):
        server = start_server(config, args.threads, args.port)
        try:
            post(args.port, {"prompt": prompts[0][:32], "n_predict": 8, "temperature": 0})  # warm-up
            decode, end_to_end, outputs, drafts = [], [], [], ""
            for _ in range(args.reps):
                rate, total_rate, outputs, drafts = run_set(args.port, prompts, args.max_tokens)
                decode.append(rate)
                end_to_end.append(total_rate)
        finally:
            server.terminate()
            server.wait()
        if reference is None:
            reference = outputs
        differing = sum(a != b for a, b in zip(outputs, reference))
        print(f"{config:18} decode {statistics.median(decode):7.1f} [{min(decode):.1f}-{max(decode):.1f}] tok/s, "
              f"end to end {statistics.median(end_to_end):7.1f} tok/s; {drafts}; outputs differing from none: {differing}; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
