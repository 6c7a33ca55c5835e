"""Batch throughput: `pagecli generate` vs transformers `generate` on the same chat prompts.

Builds 64 chat prompts of mixed length (about 20 to 600 tokens, deterministic), asks for
128 new tokens each (greedy, EOS ignored so every request does the same work), and runs
each contender in its own process so peak RSS is its own:

    .venv/bin/python scripts/bench_generate_vs_hf.py [--count 64] [--max-tokens 128]
        [--hf-sequential 8] [--hf-batch 16] [--dtype float32]

transformers one-prompt-at-a-time runs the first --hf-sequential prompts only (it is slow);
its tokens/s is a rate, so it compares directly. Prints one table; pass --json FILE to keep it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact be have do say get make go know take see come think look "
         "want give use find tell ask seem feel try leave call good new first last long great little own other old "
         "right big high different small large next early young important few public bad same able").split()


def chat_prompts(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        n_words = int(10 + (i / max(count - 1, 1)) * 440)  # about 20..600 tokens with the template
        text = " ".join(rng.choice(WORDS) for _ in range(n_words))
        prompts.append([{"role": "user", "content": f"Summarise in one paragraph: {text}"}])
    rng.shuffle(prompts)
    return prompts




HF_CHILD = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompts_file, mode, batch, max_tokens, dtype = sys.argv[1:7]
batch, max_tokens = int(batch), int(max_tokens)
tok = AutoTokenizer.from_pretrained(folder); tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
prompts = json.load(open(prompts_file))
texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
step = 1 if mode == "sequential" else batch
start = time.perf_counter(); generated = 0
for i in range(0, len(texts), step):
    enc = tok(texts[i:i + step], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    generated += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
print(json.dumps({"tokens": generated, "seconds": time.perf_counter() - start}))
"""


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run one contender; returns its stdout and its own peak RSS in GB (os.wait4 reports that child alone)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            sys.exit(f"benchmark step failed: {' '.join(cmd[:4])} ...\n{err.read()[-2000:]}")
        return out.read(), usage.ru_maxrss / 1e6  # kB -> GB (Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-sequential", type=int, default=8)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagecli.models.source import prepare_default_model

    folder = str(prepare_default_model())
    prompts = chat_prompts(args.count)
    work = Path(tempfile.mkdtemp(prefix="pagecli-bench-"))
    (work / "in.jsonl").write_text("".join(json.dumps({"messages": p}) + "\n" for p in prompts))
    (work / "prompts.json").write_text(json.dumps(prompts))
    rows = []

    start = time.perf_counter()
    env = {**os.environ, "PAGECLI_CACHE_DIR": str(work / "prefix-store")}  # an empty disk tier: a cold run
    _, rss = run_child([sys.executable, "-m", "pagecli", "generate", str(work / "in.jsonl"), "-o",
                        str(work / "out.jsonl"), "-m", folder, "--dtype", args.dtype, "-t", "0",
                        "-n", str(args.max_tokens), "--ignore-eos", "--no-progress"], env)
    wall = time.perf_counter() - start
    tokens = sum(json.loads(x)["completion_tokens"] for x in (work / "out.jsonl").read_text().splitlines())
    rows.append(("pagecli generate (whole process, load included)", args.count, tokens, wall, rss))

    for mode, n, batch in (("sequential", args.hf_sequential, 1), ("batched", args.count, args.hf_batch)):
        (work / "p.json").write_text(json.dumps(prompts[:n]))
        stdout, rss = run_child([sys.executable, "-c", HF_CHILD, folder, str(work / "p.json"), mode, str(batch),
                               str(args.max_tokens), args.dtype])
        result = json.loads(stdout.strip().splitlines()[-1])
        label = "transformers, one prompt at a time" if mode == "sequential" else f"transformers, padded batches of {batch}"
        rows.append((label, n, result["tokens"], result["seconds"], rss))

    print(f"{'run':50} {'prompts':>7} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'peak RSS GB':>11}")
    for label, n, toks, secs, rss in rows:
        print(f"{label:50} {n:>7} {toks:>7} {secs:>8.1f} {toks / secs:>7.1f} {rss:>11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("run", "prompts", "tokens", "seconds", "peak_rss_gb"), r))
                                               for r in rows], indent=2))



if __name__ == "__main__":
    main()
