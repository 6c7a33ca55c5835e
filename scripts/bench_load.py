"""What loading a model costs: seconds, resident memory after loading and at its peak, the weights' own
bytes, and single-stream decode right after.

    .venv/bin/python scripts/bench_load.py MODEL [--quantize none|int8|int4|gguf] [--dtype bfloat16]
        [--threads 2] [--tokens 32] [--streams 2]

MODEL: a model folder, a .gguf file or a hub id, as `pagecli generate -m` takes. Run it in a process of
its own per configuration (the peak is the process's): resident memory is VmRSS (anonymous and
file-backed pages mapped by the process), the peak VmHWM, both from /proc/self/status (Linux). Each
stream decodes --tokens tokens after a 32-token prompt; its rate counts from its first token.
The random-weight models of scripts/make_shape_models.py (llama2-7b among them) are the sizes to try.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from pagecli.config import EngineConfig, SamplingParams
from pagecli.engine import Engine


def memory_gib() -> tuple[float, float]:
    """(resident now, resident at the peak) of this process, GiB."""
    status = open("/proc/self/status").read()
    kib = lambda key: int(re.search(rf"{key}:\s+(\d+)", status).group(1))  # noqa: E731
    return kib("VmRSS") / 1024**2, kib("VmHWM") / 1024**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = Engine(args.model, EngineConfig(dtype=args.dtype, disk_cache=False, kv_budget_gib=1.0, max_num_seqs=4,
                                             quantize=args.quantize), progress=print)
    seconds = time.perf_counter() - start
    now, peak = memory_gib()
    print(f"loaded in {seconds:.1f} s: resident {now:.2f} GiB, peak {peak:.2f} GiB, "
          f"weights {engine.weights_bytes / 1024**3:.2f} GiB", flush=True)
    prompt = torch.randint(100, 40000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(args.streams):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True))
        times = []
        for _event in engine.stream():
            times.append(time.perf_counter())
        now, peak = memory_gib()
        print(f"decode {args.tokens / (times[-1] - times[0]):.2f} tok/s: resident {now:.2f} GiB, peak {peak:.2f} GiB",
              flush=True)
    engine.close()


if __name__ == "__main__":
    main()
