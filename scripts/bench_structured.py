"""Constrained decoding's cost: the batch workload with a JSON schema on every request against the same run
unconstrained, on the embedded model (issue 25's target: output tok/s >= 0.9x).

    .venv/bin/python scripts/bench_structured.py [--threads 2] [--reps 3] [--prompts 64] [--max-tokens 128]
        [--vllm-python PATH [--vllm-bind 0-1] [--vllm-dtype DTYPE] ...]

The prompts are bench_peers.py's batch workload (64 chat prompts of 39..596 tokens). Every request decodes
greedily to max_tokens: the schema asks for at least 8 list items, more than 128 tokens hold, so constrained
sequences run as long as unconstrained ones and both runs do the same work. Prefix caching is off, so each
repetition prefills every prompt again. Runs alternate (unconstrained, constrained, ...) so a slower minute of
the machine hits both; the figures are medians over --reps runs of each.

With --vllm-python, vLLM's CPU build runs the same token ids in the same rounds, unconstrained and with the same
schema through its default structured-output backend (StructuredOutputsParams(json=...)), greedy, EOS ignored,
prefix caching off, in pagecli's dtype unless --vllm-dtype; every core bound (peer_drivers.py's knobs). It stays
one process across rounds, so it compiles its model once (minutes) before the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.config.structured import StructuredSpec
from pagecli.engine import Engine
from pagecli.models.source import prepare_default_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import build_workloads  # noqa: E402
from peer_drivers import VllmChild, add_vllm_arguments, vllm_jobs_driver, vllm_options  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "mood": {"enum": ["positive", "neutral", "negative"]},
        "points": {"type": "array", "items": {"type": "string"}, "minItems": 8},
        "confidence": {"type": "number"},
    },
    "required": ["title", "mood", "points", "confidence"],
    "additionalProperties": False,
}


VLLM_STRUCTURED_DRIVER = vllm_jobs_driver(r"""
from vllm.sampling_params import StructuredOutputsParams
def parses(text):
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
def run(prompts, constrained, max_tokens):
    extra = {"structured_outputs": StructuredOutputsParams(json=opts["schema"])} if constrained else {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(tok_s=tokens / secs, tokens=tokens, parsed=sum(parses(o.outputs[0].text) for o in outs))
def warmup():
    run(work["prompts"][:2], True, 8)
def run_job(job):
    return run(work["prompts"], job["constrained"], job["max_tokens"])
""")


def run_once(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[float, int, int]:
    """Output tokens/s, output tokens, and how many outputs parse as JSON (complete ones only)."""
    start = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    parsed = sum(1 for o in outs if _parses(o.text))
    return tokens / seconds, tokens, parsed


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="the first N prompts of the batch workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    add_vllm_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(prepare_default_model())
    prompts = build_workloads(folder)["batch"][: args.prompts]
    engine = Engine(folder, EngineConfig(dtype="auto", disk_cache=False, enable_prefix_caching=False))
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = replace(plain, structured=StructuredSpec.json_schema(SCHEMA))
    engine.generate(prompts[:2], constrained)  # first-call costs: xgrammar's import, tokenizer table, compile
    vllm = None
    if args.vllm_python:
        print(f"starting vLLM ({args.vllm_python}); it compiles its model first ...", flush=True)
        opts = {"folder": folder, "schema": SCHEMA, **vllm_options(args, engine.stats().dtype)}
        opts["vllm_engine"]["enable_prefix_caching"] = False  # as pagecli's runs: every round prefills
        vllm = VllmChild(args, VLLM_STRUCTURED_DRIVER, {"prompts": prompts}, opts, "pagecli-structured-")
    runs = [("unconstrained", plain), ("json_schema", constrained)]
    rates: dict[str, list[float]] = {name: [] for name, _ in runs}
    if vllm is not None:
        rates.update({"vLLM unconstrained": [], "vLLM json_schema": []})
    for rep in range(args.reps):
        for name, sampling in runs:
            tok_s, tokens, parsed = run_once(engine, prompts, sampling)
            report(rates, rep, name, tok_s, tokens, parsed, len(prompts))
            if vllm is not None:
                got = vllm.run({"constrained": sampling.structured is not None, "max_tokens": args.max_tokens})
                report(rates, rep, f"vLLM {name}", got["tok_s"], got["tokens"], got["parsed"], len(prompts))
    if vllm is not None:
        vllm.close()
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.1f} tok/s (range {min(values):.1f}-{max(values):.1f})")

    def ratio(a: str, b: str) -> str:
        return f"{statistics.median(rates[a]) / statistics.median(rates[b]):.2f}"

    print(f"ratio json_schema / unconstrained: {ratio('json_schema', 'unconstrained')} ({len(prompts)} prompts x "
          f"{args.max_tokens} tokens, {args.threads} threads)")
    if vllm is not None:
        print(f"vLLM json_schema / unconstrained: {ratio('vLLM json_schema', 'vLLM unconstrained')}; "
              f"pagecli / vLLM with the schema: {ratio('json_schema', 'vLLM json_schema')}, "
              f"without: {ratio('unconstrained', 'vLLM unconstrained')}")


def report(rates: dict[str, list[float]], rep: int, name: str, tok_s: float, tokens: int, parsed: int,
           prompts: int) -> None:
    rates[name].append(tok_s)
    print(f"rep {rep + 1} {name:22s} {tok_s:7.1f} tok/s ({tokens} output tokens; {parsed} of {prompts} "
          "outputs complete JSON)", flush=True)

if __name__ == "__main__":
    main()
