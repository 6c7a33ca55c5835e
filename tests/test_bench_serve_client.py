"""scripts/bench_serve.py's streaming clients against a real `pagecli serve` stack: every request answered,
every token counted from the usage chunk, TTFT and the gaps between text chunks timed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from serve_helpers import running_server

from pagecli.bench.workloads import BenchRequest
from pagecli.config import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_serve  # noqa: E402  (a script, importable once scripts/ is on the path)


def test_the_clients_time_and_count_every_streamed_token(tiny_llama):
    sampling = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    requests = [BenchRequest(f"r{i}", "Once upon a time" if i % 2 else ({"role": "user", "content": f"hi {i}"},),
                             sampling) for i in range(6)]
    with running_server(tiny_llama, sampling=sampling) as server:
        timings, elapsed_s = asyncio.run(bench_serve.run_clients(server.base_url, server.model_id, requests, 4))
    assert len(timings) == 6 and elapsed_s > 0
    for timing in timings:
        assert timing.tokens == 7 and timing.prompt_tokens > 0
        assert 1 <= timing.text_chunks <= 7 and len(timing.gaps_s) == timing.text_chunks - 1
        assert timing.ttft_s > 0 and all(gap >= 0 for gap in timing.gaps_s)
