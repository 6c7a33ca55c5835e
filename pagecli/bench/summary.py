"""What a `bench run` recorded (a RunTrace) and the figures it reports (a RunSummary), as plain data.

The trace holds EngineStats snapshots (the engine's one stats type: before the workload, after it,
and one per step) plus two per-step figures the snapshot lacks. The summary is pure arithmetic
on the trace, so it can be checked without running a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: this module stays free of torch
    from pagecli.engine.stats import EngineStats


@dataclass(frozen=True)
class StepSample:
    """The pool right after one engine step (step 0: before the first)."""

    step: int
    time_s: float  # since the workload started
    stats: EngineStats
    slots_unused: int  # slots in active blocks that hold no token yet: internal fragmentation
    block_references: int  # block-table entries of running sequences; minus active blocks = blocks shared away


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int
    ttft_s: float | None
    max_tokens: int
    wave: int  # requests of a wave arrive together; a wave starts when the one before has finished


@dataclass(frozen=True)
class RunTrace:
    workload: str
    model: str
    samples: tuple[StepSample, ...]
    outcomes: tuple[RequestOutcome, ...]
    elapsed_s: float
    before: EngineStats  # after warm-up, before the first request
    after: EngineStats
    peak_rss_bytes: int | None
    peak_gpu_bytes: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool


@dataclass(frozen=True)
class PeakMean:
    peak: int
    mean: float


@dataclass(frozen=True)
class RunSummary:
    workload: str
    model: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    steps: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    # Pool occupancy over the samples.
    blocks_active: PeakMean
    blocks_cached: PeakMean
    blocks_free: PeakMean
    blocks_shared_peak: int
    kv_bytes_active_peak: int
    kv_bytes_used_peak: int  # active + cached
    # Internal fragmentation: allocated slots that hold no token.
    slots_unused: PeakMean
    slots_unused_share_mean: float  # of the slots in active blocks, averaged over steps with any
    # What contiguous per-request reservation at max_model_len would have needed.
    peak_concurrency: int
    contiguous_kv_bytes: int
    # Prefix sharing and the prefix cache, for this workload only (after minus before).
    blocks_saved_by_sharing_peak: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_disk_hit_tokens: int
    num_preemptions: int
    peak_rss_bytes: int | None
    peak_gpu_bytes: int | None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def prefix_disk_hit_rate(self) -> float:
        return self.prefix_disk_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def contiguous_over_paged(self) -> float | None:
        """How many times more KV memory contiguous reservation needs than paging's peak."""
        return self.contiguous_kv_bytes / self.kv_bytes_active_peak if self.kv_bytes_active_peak else None


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _peak_mean(values: Sequence[int]) -> PeakMean:
    return PeakMean(max(values), sum(values) / len(values)) if values else PeakMean(0, 0.0)


def summarize(trace: RunTrace) -> RunSummary:
    samples = trace.samples
    stats = [s.stats for s in samples]
    pool = trace.after
    kv_bytes_per_token = pool.kv_bytes_per_block // pool.block_size
    active = [s.blocks_active for s in stats]
    used = [s.blocks_active + s.blocks_cached for s in stats]
    unused_shares = [s.slots_unused / (s.stats.blocks_active * pool.block_size)
                     for s in samples if s.stats.blocks_active]
    peak_concurrency = max((s.num_running for s in stats), default=0)
    ttfts = [o.ttft_s for o in trace.outcomes if o.ttft_s is not None]
    output_tokens = sum(len(o.output_token_ids) for o in trace.outcomes)
    return RunSummary(
        workload=trace.workload,
        model=trace.model,
        num_requests=len(trace.outcomes),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in trace.outcomes),
        output_tokens=output_tokens,
        elapsed_s=trace.elapsed_s,
        steps=trace.after.num_steps - trace.before.num_steps,
        output_tokens_per_s=output_tokens / trace.elapsed_s if trace.elapsed_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        blocks_active=_peak_mean(active),
        blocks_cached=_peak_mean([s.blocks_cached for s in stats]),
        blocks_free=_peak_mean([s.blocks_free for s in stats]),
        blocks_shared_peak=max((s.blocks_shared for s in stats), default=0),
        kv_bytes_active_peak=max(active, default=0) * pool.kv_bytes_per_block,
        kv_bytes_used_peak=max(used, default=0) * pool.kv_bytes_per_block,
        slots_unused=_peak_mean([s.slots_unused for s in samples]),
        slots_unused_share_mean=sum(unused_shares) / len(unused_shares) if unused_shares else 0.0,
        peak_concurrency=peak_concurrency,
        contiguous_kv_bytes=peak_concurrency * pool.max_model_len * kv_bytes_per_token,
        blocks_saved_by_sharing_peak=max((s.block_references - s.stats.blocks_active for s in samples), default=0),
        prefix_query_tokens=trace.after.prefix_query_tokens - trace.before.prefix_query_tokens,
        prefix_hit_tokens=trace.after.prefix_hit_tokens - trace.before.prefix_hit_tokens,
        prefix_disk_hit_tokens=trace.after.prefix_disk_hit_tokens - trace.before.prefix_disk_hit_tokens,
        num_preemptions=trace.after.num_preemptions - trace.before.num_preemptions,
        peak_rss_bytes=trace.peak_rss_bytes,
        peak_gpu_bytes=trace.peak_gpu_bytes,
    )
