"""Constrained decoding's cost: the batch workload with a JSON schema on every request against the same run
unconstrained, on the embedded model (issue 25's target: output tok/s >= 0.9x).

    .venv/bin/python scripts/bench_structured.py [--threads 2] [--reps 3] [--prompts 64] [--max-tokens 128]

The prompts are bench_peers.py's batch workload (64 chat prompts of 39..596 tokens). Every request decodes
greedily to max_tokens: the schema asks for at least 8 list items, more than 128 tokens hold, so constrained
sequences run as long as unconstrained ones and both runs do the same work. Prefix caching is off, so each
repetition prefills every prompt again. Runs alternate (unconstrained, constrained, ...) so a slower minute of
the machine hits both; the figures are medians over --reps runs of each.
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(prepare_default_model())
    prompts = build_workloads(folder)["batch"][: args.prompts]
    engine = Engine(folder, EngineConfig(dtype="auto", disk_cache=False, enable_prefix_caching=False))
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = replace(plain, structured=StructuredSpec.json_schema(SCHEMA))
    engine.generate(prompts[:2], constrained)  # first-call costs: xgrammar's import, tokenizer table, compile
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for rep in range(args.reps):
        for name, sampling in (("unconstrained", plain), ("json_schema", constrained)):
            tok_s, tokens, parsed = run_once(engine, prompts, sampling)
            rates[name].append(tok_s)
            print(f"rep {rep + 1} {name:13s} {tok_s:7.1f} tok/s ({tokens} output tokens; {parsed} of {len(prompts)} "
                  "outputs complete JSON)", flush=True)
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.1f} tok/s (range {min(values):.1f}-{max(values):.1f})")
    ratio = statistics.median(rates["json_schema"]) / statistics.median(rates["unconstrained"])
    print(f"ratio json_schema / unconstrained: {ratio:.2f} ({len(prompts)} prompts x {args.max_tokens} tokens, "
          f"{args.threads} threads)")


if __name__ == "__main__":
    main()
