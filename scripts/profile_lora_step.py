"""Where a mixed LoRA decode step's time goes: one 64-row decode step of the embedded model (8 random rank-8
adapters and the base, rows i mod 9), timed over the same scheduled rows in four ways, alternated rep by rep:
the base alone in the one-call decode step; the mixed rows in the one-call step (DecodeStep.forward_lora); the
mixed rows in the Python layer loop with the native adds; the Python loop with PyTorch's batched adds (the
way before the native adds). Medians and ranges in ms. Usage:
    .venv/bin/python scripts/profile_lora_step.py THREADS QUANTIZE [REPS]   (QUANTIZE: none | auto)
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_helpers import make_adapter  # noqa: E402  (the tests' random PEFT adapters)

threads, quant = int(sys.argv[1]), sys.argv[2]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
torch.set_num_threads(threads)
common = dict(threads=threads, enable_prefix_caching=False, disk_cache=False, kv_budget_gib=0.5)
work = Path(tempfile.mkdtemp())
probe = Engine(config=EngineConfig(**common)); base = probe.loaded.folder; del probe
names = [f"a{i}" for i in range(8)]
ads = {n: make_adapter(base, work / n, rank=8, seed=i, b_scale=0.05) for i, n in enumerate(names)}
eng = Engine(config=EngineConfig(**common, quantize=quant, max_loras=8,
                                 loras=tuple((n, str(p)) for n, p in ads.items())))
print(eng.plan.summary(), flush=True)
choices = names + [None]
model = eng.loaded.model
slots = eng.adapters.slots
orig = eng.runner.execute
results = {}

def timing(scheduled):
    ds, native = model.decode_step, slots.native
    loras = [it.seq.lora for it in scheduled]
    def base():
        for it in scheduled: it.seq.lora = None
    def restore():
        for it, l in zip(scheduled, loras): it.seq.lora = l
    ways = {
        "base one-call": (base, ds, native),
        "mixed one-call (new)": (restore, ds, native),
        "mixed py loop, native adds": (restore, None, native),
        "mixed py loop, torch adds (old)": (restore, None, None),
    }
    times = {k: [] for k in ways}
    with torch.inference_mode():
        for rep in range(reps):
            for k, (setup, d, n) in ways.items():
                setup(); model.decode_step = d; slots.native = n
                t = time.perf_counter(); orig(scheduled); times[k].append(time.perf_counter() - t)
    restore(); model.decode_step = ds; slots.native = native
    for k, v in times.items():
        v = [x * 1000 for x in v[1:]]
        results[k] = v
        print(f"{k:34s} median {statistics.median(v):7.1f} ms  range {min(v):.1f}-{max(v):.1f}", flush=True)

done = [False]
def wrapper(scheduled, greedy=False):
    if not done[0] and len(scheduled) == 64 and all(it.num_new_tokens == 1 for it in scheduled):
        done[0] = True
        timing(scheduled)
    return orig(scheduled, greedy)
eng.runner.execute = wrapper
for i in range(64):
    eng.add_request(eng.encode(f"write about topic {i} now"),
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora=choices[i % 9]))
list(eng.stream())
