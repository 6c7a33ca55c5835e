"""Sampling against vLLM's CPU build: 64 prompts x 128 tokens, greedy and at the shipped sampling, both engines.

    .venv/bin/python scripts/bench_sampling_peers.py --vllm-python /tmp/vllmvenv/bin/python
        [--threads 2] [--reps 3] [--prompts 64] [--max-tokens 128] [--vllm-dtype DTYPE] [--vllm-bind 0-1] ...

The workload of bench_sampling.py's engine part (short chat prompts, EOS ignored), each round on prompts of
its own (a round number in each) so that neither engine finds the last round's prompts in its prefix cache.
A round runs pagecli greedy, pagecli at the shipped sampling (temperature 0.7, top_p 0.95), then vLLM the
same two ways on the same token ids; vLLM stays one process (peer_drivers.VllmChild), compiles its model once
and runs with prefix caching on, its workers on every core, in pagecli's dtype unless --vllm-dtype. pagecli
runs with its defaults (dtype and --quantize auto), the disk prefix store off. Sampled requests are unseeded
in both (vLLM 0.32 cannot seed a CPU request whose prefill is chunked; which tokens are drawn does not change
the work with EOS ignored). Prints each round, then medians [ranges] and the ratios of the medians and of each
round's pair.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_sampling import SHIPPED, story_prompts  # scripts/ is on sys.path
from peer_drivers import VllmChild, add_vllm_arguments, vllm_jobs_driver, vllm_options

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

WAYS = {"greedy": dict(temperature=0.0), "shipped 0.7/0.95": SHIPPED}

# Runs in vLLM's venv (peer_drivers.vllm_jobs_driver); a job is {"round": r, "way": name, "max_tokens": T}.
VLLM_SAMPLING_DRIVER = vllm_jobs_driver(r"""
def run(prompts, way, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **opts["ways"][way])
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), secs
def warmup():
    for way in opts["ways"]:
        run(work["warmup"], way, 4)
def run_job(job):
    tokens, secs = run(work["rounds"][job["round"]], job["way"], job["max_tokens"])
    return dict(tokens=tokens, seconds=secs, tok_s=tokens / secs)
""")


def round_prompts(engine: Engine, count: int, round_index: int) -> list[list[int]]:
    return [engine.encode(messages) for messages in story_prompts(count, f", round {round_index}")]


def pagecli_tok_s(engine: Engine, prompts: list[list[int]], way: str, max_tokens: int) -> float:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **WAYS[way])
    start = time.perf_counter()
    done = engine.generate(prompts, sampling)
    return sum(c.completion_tokens for c in done) / (time.perf_counter() - start)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    add_vllm_arguments(ap)
    args = ap.parse_args()

    engine = Engine(config=EngineConfig(threads=args.threads, disk_cache=False, max_num_seqs=max(64, args.prompts)))
    stats = engine.stats()
    rounds = [round_prompts(engine, args.prompts, r) for r in range(args.reps)]
    warm = round_prompts(engine, 2, -1)
    print(f"pagecli: embedded model, {stats.weight_forms}, {args.threads} threads", flush=True)
    vllm = None
    if args.vllm_python:
        print(f"starting vLLM ({args.vllm_python}); it compiles its model first ...", flush=True)
        opts = {"folder": str(engine.loaded.folder), "ways": WAYS, **vllm_options(args, stats.dtype)}
        vllm = VllmChild(args, VLLM_SAMPLING_DRIVER, {"rounds": rounds, "warmup": warm}, opts, "pagecli-sampling-")
    for way in WAYS:
        pagecli_tok_s(engine, warm, way, 4)
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.reps):
        line = [f"round {r + 1}:"]
        for way in WAYS:
            rates.setdefault(("pagecli", way), []).append(pagecli_tok_s(engine, rounds[r], way, args.max_tokens))
            line.append(f"pagecli {way} {rates['pagecli', way][-1]:.1f}")
        if vllm is not None:
            for way in WAYS:
                result = vllm.run({"round": r, "way": way, "max_tokens": args.max_tokens})
                rates.setdefault(("vllm", way), []).append(result["tok_s"])
                line.append(f"vLLM {way} {result['tok_s']:.1f}")
        print("  ".join(line), flush=True)
    if vllm is not None:
        vllm.close()
    print(f"\n{args.prompts} prompts x {args.max_tokens} tokens, {args.threads} threads, output tok/s, "
          f"median [range] of {args.reps} rounds")
    for (engine_name, way), values in rates.items():
        print(f"  {engine_name:8s} {way:18s} {spread(values)}")
    for way in WAYS:
        own = rates["pagecli", way]
        if way != "greedy":
            print(f"  pagecli {way} / pagecli greedy: "
                  f"{statistics.median(own) / statistics.median(rates['pagecli', 'greedy']):.2f}x")
        if ("vllm", way) in rates:
            peer = rates["vllm", way]
            pairs = " ".join(f"{a / b:.2f}" for a, b in zip(own, peer))
            print(f"  pagecli / vLLM, {way}: {statistics.median(own) / statistics.median(peer):.2f}x of the medians; "
                  f"per round {pairs}")


if __name__ == "__main__":
    main()
