"""LoRA adapters on the embedded model: one batch mixing adapters against the base alone and against the
adapters run one after another, merged into their weights.

Three ways to run P prompts x T output tokens (greedy, EOS ignored), prefix caching and the disk store off,
every engine on --threads threads:
- base: every prompt on the base model (pagecli's base fast paths, the native one-call decode step included);
- mixed: the same batch, prompt i on adapter i mod (A + 1) (the last share on the base), one engine;
- merged: each adapter merged into the weights (`--merge-lora`, its own engine) and its share of the prompts
  run there, the base's share on the base, one after another; engines are built before the clock starts, so
  its figure is decode and prefill only, no loading.
Adapters are random (PEFT's layout, B not zero) of rank --rank over q/k/v/o and the MLP. --quantize applies to
base and mixed (merging needs float weights: the merged engines and the base's share there run `none`). Output
tokens/s is output tokens over the wall time of the whole batch, after a warm-up; --reps R alternates the three
R times and prints medians with their ranges. On a GPU (`--device cuda`, the Triton LoRA kernels), with a model
folder of any supported shape (`--model`; scripts/make_shape_models.py makes random-weight ones) and no PEFT
installed, `--ways base,mixed` compares the mixed batch with the base batch in one engine (the adapters are
then written in PEFT's layout by this script). Usage:
    .venv/bin/python scripts/bench_lora.py [--threads 2] [--prompts 64] [--adapters 8] [--rank 8]
        [--max-tokens 64] [--reps 3] [--quantize none|auto] [--model DIR] [--device cpu|cuda] [--dtype D]
        [--ways base,mixed,merged] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

TOPICS = ["the sea", "a library", "trains", "winter", "bread", "clocks", "rivers", "maps", "bees", "glass",
          "mountains", "paper", "lamps", "gardens", "bridges", "salt"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def prompts_for(engine: Engine, count: int, round_index: int) -> list[list[int]]:
    return [engine.encode([{"role": "user", "content": f"Round {round_index}: write about {TOPICS[i % len(TOPICS)]}, "
                                                       f"note {i}."}]) for i in range(count)]


def run_batch(engine: Engine, jobs: list[tuple[list[int], str | None]], max_tokens: int) -> int:
    """Queue every job, run the engine dry; returns output tokens."""
    for ids, lora in jobs:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=lora))
    return sum(len(ev.token_ids) for ev in engine.stream())


def random_adapter(base: Path, out: Path, rank: int, seed: int, b_scale: float = 0.05) -> Path:
    """A random adapter of rank `rank` over q/k/v/o and the MLP: PEFT's own (tests/lora_helpers.make_adapter)
    where PEFT is installed, else the same layout written here from the base's config.json (a GPU machine may
    have no PEFT): A ~ U(+-1/sqrt(in)), B ~ b_scale * N(0, 1/r)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        pass
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from lora_helpers import make_adapter  # the tests' random PEFT adapters

        return make_adapter(base, out, rank=rank, seed=seed, b_scale=b_scale)
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target, (out_features, in_features) in shapes.items():
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            bound = in_features ** -0.5
            tensors[f"{key}.lora_A.weight"] = (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * b_scale / rank ** 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": ALL_TARGETS, "bias": "none"}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ways", default="base,mixed,merged", help="which of base, mixed, merged to run")
    parser.add_argument("--json", default=None, help="write the rates per way to this file")
    args = parser.parse_args()
    wanted = [way for way in args.ways.split(",") if way]
    torch.set_num_threads(args.threads)
    common = dict(threads=args.threads, enable_prefix_caching=False, disk_cache=False, kv_budget_gib=0.5,
                  device=args.device, dtype=args.dtype, gpu_memory_fraction=0.3)
    mixed_config = dict(common, quantize=args.quantize, max_loras=args.adapters)
    probe = Engine(args.model, config=EngineConfig(**common))
    base_folder = probe.loaded.folder
    del probe
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"a{i}" for i in range(args.adapters)]
    adapters = {name: random_adapter(base_folder, work / name, rank=args.rank, seed=i)
                for i, name in enumerate(names)}
    mixed = Engine(args.model, config=EngineConfig(**mixed_config,
                                                   loras=tuple((n, str(p)) for n, p in adapters.items())))
    if "merged" in wanted:
        plain = Engine(args.model, config=EngineConfig(**common, quantize="none"))
        merged = {name: Engine(args.model, config=EngineConfig(**common, quantize="none",
                                                               loras=((name, str(folder)),), merge_lora=True))
                  for name, folder in adapters.items()}
    choices = [*names, None]

    def jobs(round_index: int) -> list[tuple[list[int], str | None]]:
        return [(ids, choices[i % len(choices)]) for i, ids in enumerate(prompts_for(mixed, args.prompts, round_index))]

    def base_only(round_index: int) -> int:
        return run_batch(mixed, [(ids, None) for ids, _ in jobs(round_index)], args.max_tokens)

    def mixed_batch(round_index: int) -> int:
        return run_batch(mixed, jobs(round_index), args.max_tokens)

    def merged_in_turn(round_index: int) -> int:
        work_items = jobs(round_index)
        tokens = 0
        for name in choices:
            engine = plain if name is None else merged[name]
            tokens += run_batch(engine, [(ids, None) for ids, lora in work_items if lora == name], args.max_tokens)
        return tokens

    ways = {name: run for name, run in (("base", base_only), ("mixed", mixed_batch), ("merged", merged_in_turn))
            if name in wanted}
    for run in ways.values():
        run(-1)  # warm-up: loads the adapters, touches the pools
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(args.reps):
        for name, run in ways.items():
            start = time.perf_counter()
            tokens = run(round_index)
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"round {round_index + 1} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    on_gpu = mixed.loaded.device.type == "cuda"
    device = torch.cuda.get_device_name(0) if on_gpu else f"{cpu_name()}; {args.threads} threads"
    print(f"{device}; {mixed.model_name} ({mixed.plan.summary()} for base and mixed, float32 merged); "
          f"{args.prompts} prompts x {args.max_tokens} tokens; {args.adapters} adapters of rank {args.rank} "
          f"(q/k/v/o + MLP) and the base; {args.reps} alternating rounds")
    for name, values in rates.items():
        print(f"{name:>7}: {statistics.median(values):8.1f} tok/s (range {min(values):.1f}-{max(values):.1f})")
    medians = {name: statistics.median(values) for name, values in rates.items()}
    if "base" in medians and "mixed" in medians:
        print(f"mixed / base: {medians['mixed'] / medians['base']:.2f} (target >= 0.8)")
    if "merged" in medians and "mixed" in medians:
        print(f"mixed / merged one after another: {medians['mixed'] / medians['merged']:.2f} (target >= 1.5)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rates": rates, "medians": medians}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
