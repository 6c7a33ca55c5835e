"""`bench run`: drive the real engine through a workload and record a RunTrace.

Every figure comes from `Engine.stats()` snapshots taken before the workload, after every step
and at the end; only internal fragmentation and sharing need the running sequences' block
tables, which the snapshot does not carry. A short warm-up request runs first (so one-time
costs such as kernel compilation do not land in the first request's TTFT); it fills no
whole block, so it leaves nothing cached behind, and its counters are subtracted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagecli.bench.rss import peak_rss_bytes
from pagecli.bench.summary import RequestOutcome, RunTrace, StepSample
from pagecli.bench.workloads import BenchRequest, Prompt, Workload, conversation_prompt
from pagecli.config import SamplingParams
from pagecli.engine import Engine, EngineStats, RequestEvent
from pagecli.errors import PagecliError

EnginePrompt = str | list[dict[str, str]]
# Called as requests finish: (requests done, output tokens per second so far, the latest snapshot).
ProgressCallback = Callable[[int, float, EngineStats], None]


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    wave: int
    output_token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    ttft_s: float | None = None


def run_workload(engine: Engine, workload: Workload, model_name: str, warmup: bool = True,
                 on_progress: ProgressCallback | None = None) -> RunTrace:
    if warmup:
        warm_up(engine)
    _reset_gpu_peak(engine)
    before = engine.stats()
    recorder = _Recorder(engine, on_progress)
    if workload.conversation:
        replies: list[str] = []
        for turn, request in enumerate(workload.requests):
            texts = _run_wave(engine, recorder, [(request, conversation_prompt(workload, turn, replies))], turn)
            replies.append(texts[request.request_id])
    else:
        _run_wave(engine, recorder, [(r, _engine_prompt(r.prompt)) for r in workload.requests], 0)
    return RunTrace(
        workload=workload.name, model=model_name, samples=tuple(recorder.samples), outcomes=tuple(recorder.outcomes),
        elapsed_s=recorder.elapsed_s(), before=before, after=engine.stats(), peak_rss_bytes=peak_rss_bytes(),
        peak_gpu_bytes=_gpu_peak(engine), max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        prefix_caching=engine.config.enable_prefix_caching,
    )


def _run_wave(engine: Engine, recorder: _Recorder, requests: list[tuple[BenchRequest, EnginePrompt]],
              wave: int) -> dict[str, str]:
    """Submit `requests` together and step until all have finished; returns each one's output text."""
    pending = {request.request_id: _add(engine, request, prompt, wave) for request, prompt in requests}
    texts: dict[str, str] = {}
    while engine.has_unfinished:
        events = engine.step()
        recorder.sample()
        for event in events:
            outcome = _on_event(pending, event)
            if outcome is not None:
                texts[event.request_id] = "".join(pending.pop(event.request_id).text)
                recorder.finished(outcome)
    return texts


def warm_up(engine: Engine) -> None:
    """One prefill and one decode step on a prompt too short to fill a block (nothing gets cached)."""
    length = max(1, engine.config.block_size - 2)
    seed_ids = engine.encode("Warm up the engine before the benchmark starts.")
    prompt_ids = (seed_ids * length)[:length]
    engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), "bench-warmup")
    for _ in engine.stream():
        pass


def _engine_prompt(prompt: Prompt) -> EnginePrompt:
    return prompt if isinstance(prompt, str) else [dict(m) for m in prompt]


def _add(engine: Engine, request: BenchRequest, prompt: EnginePrompt, wave: int) -> _Pending:
    token_ids = engine.encode(prompt)
    try:
        engine.add_request(token_ids, request.sampling, request.request_id)
    except PagecliError as exc:
        raise PagecliError(f"Request '{request.request_id}': {exc}") from None
    return _Pending(request.request_id, tuple(token_ids), request.sampling.max_tokens, wave)


def _on_event(pending: dict[str, _Pending], event: RequestEvent) -> RequestOutcome | None:
    state = pending[event.request_id]
    state.output_token_ids.extend(event.token_ids)
    state.text.append(event.text)
    if state.ttft_s is None:
        state.ttft_s = event.ttft_s
    if not event.finished:
        return None
    return RequestOutcome(
        request_id=state.request_id, prompt_token_ids=state.prompt_token_ids,
        output_token_ids=tuple(state.output_token_ids), finish_reason=event.finish_reason or "stop",
        cached_tokens=event.cached_tokens, ttft_s=state.ttft_s, max_tokens=state.max_tokens, wave=state.wave,
    )


class _Recorder:
    """One StepSample per engine step, timed from the start of the workload, and the finished requests."""

    def __init__(self, engine: Engine, on_progress: ProgressCallback | None) -> None:
        self.engine = engine
        self.on_progress = on_progress
        self.start_s = time.perf_counter()
        self.samples: list[StepSample] = []
        self.outcomes: list[RequestOutcome] = []
        self.output_tokens = 0
        self.last_stats = engine.stats()
        self.sample()

    def sample(self) -> None:
        self.last_stats = self.engine.stats()
        stats = self.last_stats
        self.samples.append(StepSample(len(self.samples), self.elapsed_s(), stats, stats.slots_unused,
                                       stats.block_references))

    def finished(self, outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)
        self.output_tokens += len(outcome.output_token_ids)
        if self.on_progress:
            self.on_progress(len(self.outcomes), self.output_tokens / max(self.elapsed_s(), 1e-9), self.last_stats)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start_s


def _reset_gpu_peak(engine: Engine) -> None:
    if engine.loaded.device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(engine.loaded.device)


def _gpu_peak(engine: Engine) -> int | None:
    if engine.loaded.device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(engine.loaded.device))
