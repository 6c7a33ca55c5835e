"""Speculative decoding (issue 50): decode with and without `--speculate ngram` (prompt lookup) or
`--speculate draft` (a draft model), alternating, and whether the outputs are the same.

    .venv/bin/python scripts/bench_speculation.py [--reps 3] [--max-tokens 256] [--k 4,8]
        [--workload edit|open] [--batch N] [--sampled] [--threads 2]
        [--methods off,ngram,draft] [--model PATH] [--requests N] [--dtype D] [--quantize KIND]
        [--draft-model PATH] [--draft-quantize KIND] [--paired] [--max-batch N]
    .venv/bin/python scripts/bench_speculation.py --make-set    # rewrite scripts/data/edit_set.jsonl

--workload open: 20 open-ended story requests instead (the issue's bound: speculation on costs at most 5%
there); --batch N sends N requests together; --sampled runs the shipped sampling (0.7 / 0.95) with a seed,
where speculation must give the same tokens too. --paired runs each request with every configuration back to
back (the order alternating), so that the pairs are timed seconds apart (this machine's speed swings between
levels over minutes, which moves whole-set medians), and prints the ratio of each request's decode rate to
speculation off's, median [range] over the requests and repetitions; with --batch N, each group of N requests
sent together is run so, and its output rate (prefill included) is compared. --max-batch N lets sequences draft while up to N run
(speculate_max_batch; the engine's default is 8). --methods draft drafts with --draft-model (default: the
embedded model at its own defaults) for the main model at --dtype and --quantize (default auto).

The workload (scripts/data/edit_set.jsonl, kept in the repository): 20 requests, each a 300-600 token
excerpt of this repository's own code or docs (as they were when the set was made) with an instruction
to return it with a small change. The embedded model (SmolLM2-135M-Instruct) at the defaults a user gets
(dtype and --quantize auto), chat template applied, one request at a time, 2 threads. Prints output
tokens per second over the whole set (prefill included) and, one request at a time, the decode rate (the
tokens after each request's first over the time after it), median [range] of the repetitions, per
configuration (prefix caching off, so every repetition prefills its prompts), the drafts' acceptance
and tokens per checking pass, and the number of requests whose output differs from speculation off
(must be 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.doctor import cpu_model
from pagecli.engine import Engine
from pagecli.models.source import resolve_model

SET = Path(__file__).resolve().parent / "data" / "edit_set.jsonl"
ROOT = Path(__file__).resolve().parents[1]
SOURCES = [  # (file, instruction)
    *[(f"pagecli/engine/{name}.py", "Return this Python file unchanged except that every comment line is removed.")
      for name in ("block_pool", "scheduler", "kv_cache_manager", "sequence", "beam", "hashing", "heap",
                   "detokenizer", "pool_sizing", "model_runner")],
    *[(f"docs/{name}", "Return this text with every British spelling changed to American spelling, and "
                       "nothing else changed.")
      for name in ("ARCHITECTURE.md", "RELIABILITY.md", "prefix-store.md", "serve-api.md", "GPU.md",
                   "RAY.md", "bench-json.md", "BENCHMARKS.md", "benchmarks/sampling.md",
                   "benchmarks/host-time.md")],
]


def make_set(tokenizer) -> None:
    lines = []
    for path, instruction in SOURCES:
        text = (ROOT / path).read_text()
        ids = tokenizer.encode(text, add_special_tokens=False)
        excerpt = tokenizer.decode(ids[: 300 + len(lines) * 15], skip_special_tokens=True)  # 300-585 tokens
        lines.append(json.dumps({"source": path, "messages": [
            {"role": "user", "content": f"{instruction}\n\n{excerpt}"}]}))
    SET.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} requests to {SET}")


OPEN_TOPICS = ["a lighthouse keeper", "the first winter on Mars", "a bakery that opens at midnight",
               "two rival chess clubs", "a lost umbrella", "the oldest tree in a city", "a train that never stops",
               "a letter found in a wall", "a robot learning to paint", "a village without clocks",
               "the last bookshop", "a storm at sea", "a cat who runs a hotel", "a map of an unknown island",
               "a violin maker", "a garden on a rooftop", "a detective who hates coffee",
               "a bridge built overnight", "a festival of lanterns", "a quiet astronaut"]


def edit_prompts(tokenizer) -> list[list[int]]:
    """The editing set's 20 requests (SET), chat template applied."""
    requests = [json.loads(line) for line in SET.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True),
                             add_special_tokens=False) for r in requests]


def open_prompts(tokenizer) -> list[list[int]]:
    """20 open-ended chat requests (a story each): little of the output repeats the prompt."""
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a short story about {topic}."}], add_generation_prompt=True),
        add_special_tokens=False) for topic in OPEN_TOPICS]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, batch: int = 1,
        sampling: SamplingParams | None = None) -> tuple[float, float, list[tuple[int, ...]]]:
    """Output tokens per second over the set end to end (prefill included), the decode rate (tokens after
    each request's first over the time after it: the prompt's prefill left out; one request at a time only,
    else 0), and the outputs."""
    sampling = sampling or SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs, tokens, start = [], 0, time.perf_counter()
    decode_tokens, decode_s = 0, 0.0
    for first in range(0, len(prompts), batch):
        began = time.perf_counter()
        for done in engine.generate(prompts[first : first + batch], sampling):
            outputs.append(done.token_ids)
            tokens += done.completion_tokens
            if batch == 1 and done.ttft_s is not None:
                decode_tokens += done.completion_tokens - 1
                decode_s += time.perf_counter() - began - done.ttft_s
    return tokens / (time.perf_counter() - start), decode_tokens / decode_s if decode_s > 0 else 0.0, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", default="4,8", help="comma-separated num_speculative_tokens to try")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--make-set", action="store_true")
    ap.add_argument("--workload", choices=("edit", "open"), default="edit",
                    help="edit: the editing set; open: 20 open-ended story requests")
    ap.add_argument("--batch", type=int, default=1, help="requests sent together (default 1: one at a time)")
    ap.add_argument("--sampled", action="store_true",
                    help="the shipped sampling (temperature 0.7, top_p 0.95, seeded) instead of greedy")
    ap.add_argument("--methods", default="off,ngram", help="comma-separated: off, ngram, draft")
    ap.add_argument("--model", default=None, help="the main model (default: the embedded one)")
    ap.add_argument("--requests", type=int, default=None, help="the set's first N requests only")
    ap.add_argument("--quantize", default="auto", help="the main model's --quantize")
    ap.add_argument("--dtype", default="auto", help="the main model's --dtype")
    ap.add_argument("--draft-model", default=None, help="--speculate draft's model (default: the embedded one)")
    ap.add_argument("--draft-quantize", default="auto", help="the draft model's --quantize")
    ap.add_argument("--paired", action="store_true", help="every configuration per request, back to back")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="speculate_max_batch: drafts while at most this many sequences run (default: the engine's, 8)")
    args = ap.parse_args()
    if args.paired and "off" not in args.methods.split(","):
        ap.error("--paired compares with speculation off: keep off in --methods")
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    draft_model = args.draft_model or (str(resolve_model(None)) if "draft" in methods else None)
    # No prefix caching: with it every repetition after the first found each prompt cached (its end-to-end rate
    # was then nearly its decode rate), so repetitions were not alike.
    common = {"disk_cache": False, "enable_prefix_caching": False, "threads": args.threads, "quantize": args.quantize,
              "dtype": args.dtype}
    if args.max_batch is not None:
        common["speculate_max_batch"] = args.max_batch
    configs = {"off": EngineConfig(**common, speculate="off")} if "off" in methods else {}
    for k in (int(v) for v in args.k.split(",")):
        if "ngram" in methods:
            configs[f"ngram k={k}"] = EngineConfig(**common, speculate="ngram", num_speculative_tokens=k)
        if "draft" in methods:
            configs[f"draft k={k}"] = EngineConfig(**common, speculate="draft", num_speculative_tokens=k,
                                                   draft_model=draft_model, draft_quantize=args.draft_quantize)
    if args.batch == 1:  # one request at a time, as chat or a one-line generate runs (their engine's dtype)
        configs = {name: config.for_one_stream() for name, config in configs.items()}
    engines = {name: Engine(args.model, config) for name, config in configs.items()}
    tokenizer = next(iter(engines.values())).tokenizer
    if args.make_set:
        make_set(tokenizer)
        return
    prompts = edit_prompts(tokenizer) if args.workload == "edit" else open_prompts(tokenizer)
    prompts = prompts[: args.requests]
    sampling = SamplingParams(temperature=0.7, top_p=0.95, seed=1, max_tokens=args.max_tokens) if args.sampled \
        else SamplingParams(temperature=0, max_tokens=args.max_tokens)
    forms = "; ".join(f"{name}: {engine.stats().weight_forms}" + (
        f", draft {engine.drafter.engine.stats().weight_forms}" if engine.drafter else "")
        for name, engine in engines.items() if name in ("off", f"draft k={args.k.split(',')[0]}"))
    print(f"weights: {forms}")
    print(f"CPU: {cpu_model()}; {args.threads} threads; {len(prompts)} {args.workload} requests "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens), {args.batch} at a time, "
          f"{'sampled 0.7/0.95, seeded' if args.sampled else 'greedy'}, max_tokens {args.max_tokens}; "
          f"output tok/s over the set")
    if args.paired:
        paired(engines, prompts, args.max_tokens, sampling, args.reps, args.batch)
        return
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    decode_speeds: dict[str, list[float]] = {name: [] for name in engines}
    reference: list[tuple[int, ...]] | None = None
    differing: dict[str, int] = {name: 0 for name in engines}
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            speed, decode_speed, outputs = run(engines[name], prompts, args.max_tokens, args.batch, sampling)
            speeds[name].append(speed)
            decode_speeds[name].append(decode_speed)
            if name == "off" or "off" not in engines and reference is None:
                reference = outputs if reference is None else reference
            elif reference is not None:
                differing[name] = max(differing[name], sum(a != b for a, b in zip(outputs, reference)))
            print(f"  rep {rep + 1} {name:10} {speed:7.1f} tok/s (decode {decode_speed:.1f})", flush=True)
    base = statistics.median(next(iter(speeds.values())))
    decode_base = statistics.median(next(iter(decode_speeds.values())))
    for name, values in speeds.items():
        stats = engines[name].stats()
        extra = "" if not stats.spec_passes else (
            f"; acceptance {stats.spec_acceptance:.0%}, {stats.spec_tokens / stats.spec_passes:.2f} tokens per pass, "
            f"outputs differing from off: {differing[name]}; a row's measured cost r = "
            f"{engines[name].speculator.row_cost.value:.2f} of a one-row step{_batch_cost(engines[name], args.batch)}"
            f"{_draft_cost(engines[name])}")
        decode = decode_speeds[name]
        decode_part = "" if not decode_base else (
            f"; decode {statistics.median(decode):.1f} [{min(decode):.1f}-{max(decode):.1f}] "
            f"({statistics.median(decode) / decode_base:.2f}x)")
        print(f"{name:10} {statistics.median(values):7.1f} [{min(values):.1f}-{max(values):.1f}] tok/s "
              f"({statistics.median(values) / base:.2f}x){decode_part}{extra}")


def paired(engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int, sampling: SamplingParams,
           reps: int, batch: int = 1) -> None:
    """Each request (each group of `batch` requests sent together) with every configuration back to back, the
    order alternating; per configuration, the ratio of each request's decode rate (a group's output tok/s,
    prefill included) to speculation off's, and the rate over all of them."""
    ratios: dict[str, list[float]] = {name: [] for name in engines if name != "off"}
    tokens = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    differing = {name: 0 for name in engines}
    groups = [prompts[first : first + batch] for first in range(0, len(prompts), batch)]
    for rep in range(reps):
        for i, group in enumerate(groups):
            order = list(engines) if (rep + i) % 2 == 0 else list(reversed(engines))
            rates, outputs = {}, {}
            for name in order:
                speed, decode_rate, outputs[name] = run(engines[name], group, max_tokens, batch, sampling)
                rates[name] = decode_rate if batch == 1 else speed
                done_tokens = sum(len(out) - (1 if batch == 1 else 0) for out in outputs[name])
                tokens[name] += done_tokens
                seconds[name] += done_tokens / rates[name] if rates[name] else 0.0
            for name in ratios:
                if rates["off"] and rates[name]:
                    ratios[name].append(rates[name] / rates["off"])
                differing[name] += sum(a != b for a, b in zip(outputs[name], outputs["off"]))
        line = ", ".join(f"{name} {statistics.median(r[-len(groups):]):.2f}x" for name, r in ratios.items())
        print(f"  rep {rep + 1}: per-{'request decode' if batch == 1 else 'group'} ratio, median: {line}",
              flush=True)
    what = "decode" if batch == 1 else "output (prefill included)"
    for name in engines:
        rate = tokens[name] / seconds[name] if seconds[name] else 0.0
        extra = ""
        if name in ratios and ratios[name]:
            r, stats = ratios[name], engines[name].stats()
            extra = (f"; per-{'request' if batch == 1 else 'group'} ratio to off {statistics.median(r):.2f}x "
                     f"[{min(r):.2f}-{max(r):.2f}] over {len(r)} pairs, whole set "
                     f"{rate * seconds['off'] / tokens['off']:.2f}x")
            if stats.spec_passes:
                extra += (f"; acceptance {stats.spec_acceptance:.0%}, {stats.spec_tokens / stats.spec_passes:.2f} "
                          f"tokens per pass; outputs differing from off: {differing[name]}"
                          f"{_batch_cost(engines[name], batch)}")
        print(f"{name:10} {what} {rate:.1f} tok/s over {tokens[name]} tokens{extra}")


def _batch_cost(engine: Engine, batch: int) -> str:
    """r and c a sequence's drafts were weighed with in the set's batches (their part of a batch's step)."""
    if batch == 1:
        return ""
    row_cost, pass_cost = engine.speculator.row_cost.costs(batch)
    return f"; in batches of {batch}: r = {row_cost:.2f}, c = {pass_cost:.2f} of a sequence's part of a step"


def _draft_cost(engine: Engine) -> str:
    """A draft model's measured step, as a share of a plain main step (what each draft adds to r)."""
    drafter, cost = engine.drafter, engine.speculator.row_cost
    if drafter is None or drafter.seconds_per_draft is None or not cost.plain_step_s:
        return ""
    return (f", a draft step {drafter.seconds_per_draft * 1e3:.1f} ms = "
            f"{drafter.seconds_per_draft / cost.plain_step_s:.2f} of a plain step ({cost.plain_step_s * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
