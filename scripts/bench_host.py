"""The engine's host time per decode step, and its parts (issue 44), on any machine.

    .venv/bin/python scripts/bench_host.py [--seqs 1,64,256] [--steps 40] [--threads 1] [--json OUT]

The model has real depth and vocabulary but negligible width (scripts/make_shape_models.py's `host-probe`:
30 layers, hidden 64, one head of 64, the embedded model's 49,152-token vocabulary), so its arithmetic
costs little (but for the output layer's, timed apart) and what a step takes is mostly the host's: scheduling, building the step's inputs, the
Python around the kernels, sampling, stop checks and detokenizing, stats. Each case starts N requests
(16-token prompts, `max_tokens` past the run, EOS ignored), lets them reach steady decode, then times
`--steps` engine steps with timers around each part:

  schedule   Scheduler.schedule (and the copy-on-write copies)
  inputs     ModelRunner.prepare: token ids, positions, block tables, slot mapping as tensors
  layers     the forward through the decoder layers (products, norms, attention): arithmetic, plus the
             Python between kernels where a step is not one native call
  logits     the output layer: real arithmetic even here (49,152 x 64 per row), and each row's greedy
             choice where the output product takes it as it writes the logits (PAGECLI_GREEDY_IN_OUTPUT=0: not)
  sample     engine.sampler.sample over the step's logits (the greedy pass over them where the product did not)
  tokens     per sequence: append, stop checks, detokenize, events (Engine._on_token)
  other      the rest of Engine.step (bookkeeping between the parts)
  host       a step less its layers and logits: what issue 44 asks to bring under 1 ms at 64 sequences
  stats      one Engine.stats() snapshot per step, as the progress bar and the chat panel take it

Cases: greedy and the shipped sampling (temperature 0.7, top_p 0.95), prefix caching on (shared
prompt head) and off, n=4 forks, and a JSON-schema constraint. Figures are medians over the steps, in
ms; the CPU is named. Pin threads (--threads 1 by default) on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_shape_models import make_model  # noqa: E402

from pagecli.config import EngineConfig, SamplingParams  # noqa: E402
from pagecli.config.structured import StructuredSpec  # noqa: E402
from pagecli.engine import Engine  # noqa: E402
from pagecli.doctor import cpu_model  # noqa: E402
from pagecli.engine import engine as engine_module  # noqa: E402

PARTS = ("schedule", "inputs", "layers", "logits", "sample", "tokens", "other", "stats")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


class Timers:
    """Seconds per part in the current step. With sync (a GPU), each part waits for the device at its end,
    so a part's time is its launches plus the device work they queued."""

    def __init__(self, sync: bool = False) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.sync = sync

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.current[part] += time.perf_counter() - start
        return timed


def instrument(engine: Engine, timers: Timers) -> None:
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine.runner.copy_blocks = timers.wrap("schedule", engine.runner.copy_blocks)
    engine.runner.prepare = timers.wrap("inputs", engine.runner.prepare)
    model = engine.loaded.model
    model.forward = timers.wrap("layers", model.forward)
    model.logits_and_greedy = timers.wrap("logits", model.logits_and_greedy)  # the output layer (and greedy choice)
    engine._on_token = timers.wrap("tokens", engine._on_token)
    engine_module.sample = timers.wrap("sample", engine_module.sample)


def prompts(count: int, shared_head: bool) -> list[list[int]]:
    """16-token prompts of token ids; with shared_head, the first 8 are the same in all (a prefix hit)."""
    head = list(range(1000, 1008))
    return [(head if shared_head else [2000 + i % 500] * 8) + [3000 + i * 7 % 9000 + j for j in range(8)]
            for i in range(count)]


def run_case(folder: Path, seqs: int, sampling: SamplingParams, prefix_caching: bool, steps: int,
             threads: int, device: str = "cpu", sync: bool = False) -> dict[str, Any]:
    torch.set_num_threads(threads)
    config = EngineConfig(dtype="float32" if device == "cpu" else "bfloat16", device=device, disk_cache=False,
                          enable_prefix_caching=prefix_caching,
                          max_num_seqs=max(seqs * sampling.n, 1), num_blocks=max(64, seqs * sampling.n * 8),
                          block_size=16, max_num_batched_tokens=max(2048, seqs * 16), quantize="none")
    engine = Engine(str(folder), config)
    timers = Timers(sync)
    instrument(engine, timers)
    for ids in prompts(seqs, shared_head=prefix_caching):
        engine.add_request(ids, sampling)
    for _ in range(3):  # prefill and the first decodes: not timed
        engine.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    totals = []
    running = []
    for _ in range(steps):
        if not engine.has_unfinished:
            break
        timers.current = defaultdict(float)
        start = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - start
        stats_start = time.perf_counter()
        engine.stats()
        timers.current["stats"] += time.perf_counter() - stats_start
        timers.current["other"] = step_s - sum(v for k, v in timers.current.items() if k != "stats")
        for part in PARTS:
            per_step[part].append(timers.current.get(part, 0.0) * 1e3)
        totals.append(step_s * 1e3)
        running.append(len(engine.scheduler.running))
    engine.close()
    return {"running": statistics.median(running), "step_ms": statistics.median(totals),
            "host_ms": statistics.median([t - a - b for t, a, b in zip(totals, per_step["layers"], per_step["logits"])]),
            **{part: statistics.median(values) for part, values in per_step.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1,64,256", help="comma-separated running sequences per case")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default=str(Path.home() / ".cache" / "pagecli-bench" / "models"))
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="folder with SmolLM2's tokenizer files (default: the embedded model's)")
    ap.add_argument("--device", default="cpu", help="cpu (float32) or cuda (bfloat16, the Triton kernels)")
    ap.add_argument("--sync-parts", action="store_true",
                    help="on a GPU, wait for the device at the end of each part (its launches plus its kernels); "
                         "without it a GPU part is its launches only, and the wait falls in the part that copies")
    args = ap.parse_args()
    from pagecli import native
    from pagecli.models.source import prepare_default_model

    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else prepare_default_model()
    folder = make_model("host-probe", Path(args.models), tokenizer_dir)
    greedy = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    shipped = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=100_000, ignore_eos=True)
    cases = []
    for seqs in (int(s) for s in args.seqs.split(",")):
        cases += [("greedy", seqs, greedy, True), ("shipped sampling", seqs, shipped, True),
                  ("greedy, no prefix caching", seqs, greedy, False)]
        if seqs >= 4:
            cases.append(("shipped sampling, n=4 forks", seqs // 4,
                          SamplingParams(temperature=0.7, top_p=0.95, n=4, max_tokens=100_000, ignore_eos=True), True))
        cases.append(("greedy, JSON schema", seqs,
                      SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True,
                                     structured=StructuredSpec.json_schema(SCHEMA)), True))
    where = (f"GPU: {torch.cuda.get_device_name(0)}, bfloat16, parts {'synchronized' if args.sync_parts else 'as launched'}; "
             if args.device.startswith("cuda") else f"pagecli.native level {native.level()}; ")
    print(f"CPU: {cpu_model()}; {where}{args.threads} thread(s); host-probe model; "
          f"medians of {args.steps} steady decode steps, ms per step")
    header = f"{'case':34} {'seqs':>5} {'step':>7} {'host':>7} " + " ".join(f"{p:>8}" for p in PARTS)
    print(header)
    rows = []
    for name, seqs, sampling, caching in cases:
        row = run_case(folder, seqs, sampling, caching, args.steps, args.threads, args.device, args.sync_parts)
        rows.append({"case": name, **row})
        print(f"{name:34} {row['running']:>5.0f} {row['step_ms']:>7.2f} {row['host_ms']:>7.2f} "
              + " ".join(f"{row[p]:>8.2f}" for p in PARTS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "device": args.device, "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
