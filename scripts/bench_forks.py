"""Parallel sampling (n > 1) on the embedded model: time to first token, and output tokens/s.

ttft: one n=N request against n=1 on the same prompt, alternating, prefix caching and the disk
store off (every repetition prefills); issue 27's target is a ratio <= 1.2.
throughput: P prompts x n=N x T tokens as P forked requests, against the same P*N sequences sent
as separate requests with prefix caching on (disk store off; --separate-uncached: also on an engine
with prefix caching off, where every copy prefills its prompt), and with --vllm-python against vLLM's
CPU build running the same token ids as P requests with SamplingParams(n=N) (temperature 1.0, EOS
ignored, unseeded: see VLLM_FORKS_DRIVER; prefix caching on, pagecli's dtype unless --vllm-dtype;
its knobs and core binding are bench_peers.py's, from peer_drivers.py). Output tokens/s is output
tokens over the wall time of the whole batch, after a warm-up. --reps R alternates pagecli forked and vLLM R times, each
round on prompts of its own (so each round prefills in both engines), and prints medians and ranges;
vLLM stays one process, so it compiles its model once (minutes) before the first round. Usage:
    .venv/bin/python scripts/bench_forks.py ttft [--threads 2] [--reps 7] [--prompt-tokens 512] [--n 8]
    .venv/bin/python scripts/bench_forks.py throughput [--threads 2] [--prompts 16] [--n 8] [--max-tokens 128]
        [--reps 1] [--no-separate] [--separate-uncached] [--vllm-python PATH [--vllm-bind 0-1] [--vllm-max-num-seqs S]
        [--vllm-max-num-batched-tokens B] [--vllm-kvcache-gib G] [--vllm-dtype DTYPE]]
"""

from __future__ import annotations

import argparse
import statistics
import time

from peer_drivers import VllmChild, add_vllm_arguments, vllm_jobs_driver, vllm_options  # scripts/ is on sys.path

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

TEXT = "Paged attention keeps the KV cache in fixed-size blocks, shared by reference count. " * 64


def ttft_s(engine: Engine, prompt: list[int], n: int) -> float:
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=1, ignore_eos=True, n=n))
    return min(ev.ttft_s for ev in engine.stream() if ev.ttft_s is not None)


def run_ttft(args: argparse.Namespace) -> None:
    engine = Engine(config=EngineConfig(threads=args.threads, enable_prefix_caching=False, disk_cache=False))
    prompt = engine.encode(TEXT)[: args.prompt_tokens]
    ttft_s(engine, prompt, 1)  # warm-up
    times: dict[int, list[float]] = {1: [], args.n: []}
    for _ in range(args.reps or 7):
        for n in (1, args.n):
            times[n].append(ttft_s(engine, prompt, n))
    for n, values in times.items():
        print(f"n={n}: TTFT median {statistics.median(values) * 1e3:.1f} ms "
              f"(range {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}, {len(values)} runs)")
    ratio = statistics.median(times[args.n]) / statistics.median(times[1])
    print(f"ratio n={args.n} / n=1: {ratio:.2f} ({len(prompt)} prompt tokens, {args.threads} threads)")


# Runs in vLLM's venv, one job ({"round": r, "max_tokens": T}) per round (peer_drivers.vllm_jobs_driver).
# No seeds: vLLM 0.32 rewinds a seeded request's generator after a chunked prefill step with
# Generator.set_offset, which only CUDA generators have ("CPU Generator does not use offset"; the full
# workload's 8,000 prompt tokens exceed its 4,096-token step budget). Which tokens are drawn does not
# change the work, EOS being ignored.
VLLM_FORKS_DRIVER = vllm_jobs_driver(r"""
def run(prompts, n, max_tokens):
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outs for c in o.outputs), secs
def warmup():
    run(work["warmup"], opts["n"], 2)
def run_job(job):
    tokens, secs = run(work["rounds"][job["round"]], opts["n"], job["max_tokens"])
    return dict(tokens=tokens, seconds=secs, tok_s=tokens / secs)
""")


def output_tok_s(engine: Engine, prompts: list[list[int]], n: int, copies: int, max_tokens: int) -> tuple[float, int]:
    """Output tokens/s and peak active blocks for each prompt sent `copies` times with n candidates each."""
    for i, prompt in enumerate(prompts):
        for copy in range(copies):
            engine.add_request(prompt, SamplingParams(temperature=1.0, seed=i * 1000 + copy, max_tokens=max_tokens,
                                                      ignore_eos=True, n=n))
    start, tokens, peak = time.perf_counter(), 0, 0
    while engine.has_unfinished:
        tokens += sum(len(ev.token_ids) for ev in engine.step())
        peak = max(peak, engine.pool.counts().active)
    return tokens / (time.perf_counter() - start), peak


def round_prompts(engine: Engine, base: list[int], args: argparse.Namespace, round_index: int) -> list[list[int]]:
    """Round r's P prompts: a question header of their own (no prefix hits on another round's) + the shared text."""
    header = "Question {i}: " if round_index == 0 else f"Round {round_index}, question {{i}}: "
    return [engine.encode(header.format(i=i)) + base[: args.prompt_tokens] for i in range(args.prompts)]


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f} tok/s"
    return (f"median {statistics.median(values):.1f} tok/s "
            f"(range {min(values):.1f}-{max(values):.1f}, {len(values)} runs)")


def run_throughput(args: argparse.Namespace) -> None:
    reps = args.reps or 1
    config = EngineConfig(threads=args.threads, disk_cache=False, max_num_seqs=args.prompts * args.n)
    engine = Engine(config=config)
    base = engine.encode(TEXT)
    rounds = [round_prompts(engine, base, args, r) for r in range(reps)]
    warmup = engine.encode("Warm-up: ") + base[: args.prompt_tokens]
    dtype = engine.stats().dtype  # vLLM runs in it unless --vllm-dtype says otherwise
    vllm = None
    if args.vllm_python:
        print(f"starting vLLM ({args.vllm_python}); it compiles its model first ...", flush=True)
        opts = {"folder": str(engine.loaded.folder), "n": args.n, **vllm_options(args, dtype)}
        vllm = VllmChild(args, VLLM_FORKS_DRIVER, {"rounds": rounds, "warmup": [warmup]}, opts, "pagecli-forks-")
    output_tok_s(engine, [warmup], args.n, 1, 2)  # warm-up
    forked: list[float] = []
    peers: list[float] = []
    forked_peak = 0
    for r in range(reps):
        tok_s, forked_peak = output_tok_s(engine, rounds[r], args.n, 1, args.max_tokens)
        forked.append(tok_s)
        line = f"round {r + 1}: pagecli forked {tok_s:.1f} tok/s"
        if vllm is not None:
            peers.append(vllm.run({"round": r, "max_tokens": args.max_tokens})["tok_s"])
            line += f", vLLM n={args.n} {peers[-1]:.1f} tok/s"
        print(line, flush=True)
    if vllm is not None:
        vllm.close()
    print(f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, {args.threads} threads "
          f"(pagecli {dtype}): pagecli forked {summary(forked)} (peak {forked_peak} blocks)")
    if peers:
        # Each round's two runs are next to each other in time, so their ratio is the one a machine whose
        # speed swings spoils least.
        per_round = [f / v for f, v in zip(forked, peers)]
        print(f"  vLLM CPU build, SamplingParams(n={args.n}), {args.vllm_dtype or dtype}: {summary(peers)}\n"
              f"  pagecli / vLLM: {statistics.median(forked) / statistics.median(peers):.2f}x of the medians; "
              f"per round {' '.join(f'{r:.2f}' for r in per_round)} (median {statistics.median(per_round):.2f}x)")
    if not args.no_separate:
        # Prompts of their own: with prefix caching on, each prompt's first request prefills it and the other
        # n - 1 find its blocks in the cache (a forked round's prompts would all be found there, prefill-free).
        fresh = round_prompts(engine, base, args, reps)
        separate, separate_peak = output_tok_s(engine, fresh, 1, args.n, args.max_tokens)
        print(f"  separate requests with prefix caching {separate:.1f} tok/s (peak {separate_peak} blocks); "
              f"ratio forked / separate {statistics.median(forked) / separate:.2f}")
    if args.separate_uncached:
        # What forking saves where nothing else shares the prompt: every copy prefills it.
        engine.close()
        uncached = Engine(config=EngineConfig(threads=args.threads, disk_cache=False, enable_prefix_caching=False,
                                              max_num_seqs=args.prompts * args.n))
        output_tok_s(uncached, [warmup], 1, 1, 2)  # warm-up
        alone, alone_peak = output_tok_s(uncached, round_prompts(uncached, base, args, reps + 1), 1, args.n,
                                         args.max_tokens)
        uncached.close()
        print(f"  separate requests, prefix caching off {alone:.1f} tok/s (peak {alone_peak} blocks); "
              f"ratio forked / separate {statistics.median(forked) / alone:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("ttft", "throughput"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="ttft: 7 unless told; throughput: 1")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-separate", action="store_true", help="throughput: skip the separate-requests run")
    parser.add_argument("--separate-uncached", action="store_true",
                        help="throughput: also the separate requests on an engine with prefix caching off")
    add_vllm_arguments(parser)
    args = parser.parse_args()
    if args.what == "ttft" and args.vllm_python:
        parser.error("--vllm-python is for throughput")
    run_ttft(args) if args.what == "ttft" else run_throughput(args)


if __name__ == "__main__":
    main()
