"""Concurrent clients mixed across the four APIs (scripts/bench_serve_apis.py's clients, smaller): every
request answered in full with no error, and each API's greedy text equal to Chat Completions' for the same
conversation."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pagecli.config import SamplingParams
from serve_helpers import checked_idle, running_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_serve_apis  # noqa: E402  (a script, importable once scripts/ is on the path)

CLIENTS, REQUESTS, MAX_TOKENS = 16, 48, 6


def test_sixteen_clients_across_four_apis_are_all_answered_with_chat_completions_text(tiny_llama):
    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    mixed = bench_serve_apis.asks(REQUESTS, seed=1, mixed=True)
    alone = bench_serve_apis.asks(REQUESTS, seed=1, mixed=False)  # the same conversations, Chat Completions only
    with running_server(tiny_llama, sampling=sampling, num_blocks=256) as server:
        run = bench_serve_apis.run_pass
        answers, _ = asyncio.run(run(server.base_url, server.model_id, mixed, CLIENTS, MAX_TOKENS))
        reference, _ = asyncio.run(run(server.base_url, server.model_id, alone, CLIENTS, MAX_TOKENS))
        checked_idle(server)
    row = bench_serve_apis.row("mixed", 0, answers, 1.0, MAX_TOKENS)
    assert row["failed"] == 0 and row["requests"] == REQUESTS, row["first_failure"]
    assert row["by_api"] == {api: REQUESTS // 4 for api in bench_serve_apis.APIS}
    assert {(a.api, a.stream) for a in answers} == {(api, s) for api in bench_serve_apis.APIS for s in (False, True)}
    for answer, chat in zip(answers, reference):
        assert answer.text == chat.text, (answer.api, answer.stream, answer.text, chat.text)
