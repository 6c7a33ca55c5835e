"""The `--json` documents of `bench memory` and `bench run`; docs/bench-json.md is their schema.

Each document names its schema (`pagecli.bench.memory/1`, `pagecli.bench.run/1`). Within a
version, fields are only ever added; a rename or a change of meaning bumps the version.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagecli import __version__
from pagecli.bench.compare_hf import Comparison
from pagecli.bench.memory import MemoryReport
from pagecli.bench.model_info import AdapterMemory, ModelKV
from pagecli.bench.summary import PeakMean, RunSummary, RunTrace
from pagecli.errors import PagecliError

MEMORY_SCHEMA = "pagecli.bench.memory/1"
RUN_SCHEMA = "pagecli.bench.run/1"


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def memory_document(report: MemoryReport, model: ModelKV | None,
                    other: tuple[str, MemoryReport] | None = None, adapters: Sequence[AdapterMemory] = ()
                    ) -> dict[str, Any]:
    c = report.contiguous
    return {
        "adapters": [{"name": a.name, "rank": a.rank, "bytes": a.nbytes} for a in adapters],
        "schema": MEMORY_SCHEMA,
        "pagecli_version": __version__,
        "inputs": {
            "num_requests": report.num_requests,
            "lengths": list(report.lengths),
            "max_len": report.max_len,
            "block_sizes": [p.block_size for p in report.paged],
            "shared_prefix_tokens": report.shared_prefix_tokens,
            "kv_bytes_per_token": report.kv_bytes_per_token,
            "budget_bytes": report.budget_bytes,
            "model": None if model is None else {
                "name": model.name, "model_type": model.model_type, "num_layers": model.num_layers,
                "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim, "dtype": model.dtype,
                "dtype_bytes": model.dtype_bytes,
            },
        },
        "contiguous": {
            "reserved_slots": c.reserved_slots, "wasted_slots": c.wasted_slots, "waste_share": _round(c.waste_share),
            "reserved_bytes": c.reserved_bytes, "requests_fit": c.requests_fit,
        },
        "paged": _paged_documents(report),
        "kv_dtype": None if other is None else {
            "kv_dtype": other[0], "kv_bytes_per_token": other[1].kv_bytes_per_token,
            "contiguous": {"reserved_bytes": other[1].contiguous.reserved_bytes,
                           "requests_fit": other[1].contiguous.requests_fit},
            "paged": _paged_documents(other[1]),
        },
        "requests": [
            {
                "length": length,
                "contiguous_reserved_slots": report.max_len,
                "contiguous_wasted_slots": report.max_len - length,
                "paged": [
                    {"block_size": p.block_size, "blocks": p.requests[i].paged_blocks,
                     "allocated_slots": p.requests[i].paged_allocated_slots,
                     "wasted_slots": p.requests[i].paged_wasted_slots}
                    for p in report.paged
                ],
            }
            for i, length in enumerate(report.lengths)
        ],
    }


def _paged_documents(report: MemoryReport) -> list[dict[str, Any]]:
    return [
        {
            "block_size": p.block_size, "blocks": p.blocks, "allocated_slots": p.allocated_slots,
            "wasted_slots": p.wasted_slots, "waste_share": _round(p.waste_share),
            "waste_bound_slots": p.waste_bound_slots, "shared_prefix_blocks": p.shared_prefix_blocks,
            "blocks_saved_by_sharing": p.blocks_saved_by_sharing, "blocks_with_sharing": p.blocks_with_sharing,
            "kv_bytes_per_block": p.kv_bytes_per_block, "allocated_bytes": p.allocated_bytes,
            "bytes_with_sharing": p.bytes_with_sharing, "requests_fit": p.requests_fit,
        }
        for p in report.paged
    ]


def _peak_mean(value: PeakMean) -> dict[str, Any]:
    return {"peak": value.peak, "mean": _round(value.mean, 3)}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return _round(ours / theirs, 4) if ours is not None and theirs else None


def run_document(summary: RunSummary, trace: RunTrace, compare: Comparison | None) -> dict[str, Any]:
    after = trace.after
    return {
        "schema": RUN_SCHEMA,
        "pagecli_version": __version__,
        "workload": {"name": summary.workload, "num_requests": summary.num_requests,
                     "prompt_tokens": summary.prompt_tokens, "output_tokens": summary.output_tokens},
        "engine": {
            "model": summary.model, "device": after.device, "dtype": after.dtype,
            "attention_backend": after.attention_backend, "block_size": after.block_size,
            "num_blocks": after.num_blocks, "max_model_len": after.max_model_len,
            "max_num_seqs": trace.max_num_seqs, "max_num_batched_tokens": trace.max_num_batched_tokens,
            "prefix_caching": trace.prefix_caching, "kv_bytes_per_token": after.kv_bytes_per_block // after.block_size,
            "kv_bytes_per_block": after.kv_bytes_per_block, "kv_bytes_total": after.kv_bytes_total,
            "weights_bytes": after.weights_bytes,
        },
        "throughput": {
            "elapsed_s": _round(summary.elapsed_s), "steps": summary.steps,
            "output_tokens_per_s": _round(summary.output_tokens_per_s, 3),
            "ttft_p50_s": _round(summary.ttft_p50_s), "ttft_p95_s": _round(summary.ttft_p95_s),
        },
        "blocks": {
            "active": _peak_mean(summary.blocks_active), "cached": _peak_mean(summary.blocks_cached),
            "free": _peak_mean(summary.blocks_free), "shared_peak": summary.blocks_shared_peak,
        },
        "memory": {
            "kv_bytes_active_peak": summary.kv_bytes_active_peak,
            "kv_bytes_used_peak": summary.kv_bytes_used_peak,
            "internal_fragmentation": {
                "slots_unused_peak": summary.slots_unused.peak,
                "slots_unused_mean": _round(summary.slots_unused.mean, 3),
                "share_of_active_slots_mean": _round(summary.slots_unused_share_mean),
            },
            "contiguous": {
                "peak_concurrency": summary.peak_concurrency, "max_model_len": after.max_model_len,
                "kv_bytes": summary.contiguous_kv_bytes,
                "times_paged_peak": _round(summary.contiguous_over_paged, 3),
            },
            "peak_rss_bytes": summary.peak_rss_bytes, "peak_gpu_bytes": summary.peak_gpu_bytes,
        },
        "prefix": {
            "query_tokens": summary.prefix_query_tokens, "hit_tokens": summary.prefix_hit_tokens,
            "disk_hit_tokens": summary.prefix_disk_hit_tokens, "hit_rate": _round(summary.prefix_hit_rate),
            "disk_hit_rate": _round(summary.prefix_disk_hit_rate),
            "blocks_saved_by_sharing_peak": summary.blocks_saved_by_sharing_peak,
        },
        "preemptions": summary.num_preemptions,
        "timeline": {
            "time_s": [_round(s.time_s) for s in trace.samples],
            "active": [s.stats.blocks_active for s in trace.samples],
            "cached": [s.stats.blocks_cached for s in trace.samples],
            "free": [s.stats.blocks_free for s in trace.samples],
            "shared": [s.stats.blocks_shared for s in trace.samples],
            "running": [s.stats.num_running for s in trace.samples],
            "waiting": [s.stats.num_waiting for s in trace.samples],
            "slots_unused": [s.slots_unused for s in trace.samples],
        },
        "requests": [
            {"id": o.request_id, "prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.output_token_ids),
             "cached_tokens": o.cached_tokens, "ttft_s": _round(o.ttft_s), "finish_reason": o.finish_reason}
            for o in trace.outcomes
        ],
        "engine_stats": {"before": trace.before.to_dict(), "after": after.to_dict()},
        "compare": None if compare is None else _compare_document(summary, compare),
    }


def _compare_document(summary: RunSummary, compare: Comparison) -> dict[str, Any]:
    hf = compare.hf
    agreement = compare.agreement
    return {
        "hf": {
            "transformers_version": hf.transformers_version, "batch_size": hf.batch_size,
            "elapsed_s": _round(hf.elapsed_s), "output_tokens": hf.output_tokens,
            "output_tokens_per_s": _round(compare.hf_output_tokens_per_s, 3),
            "ttft_p50_s": _round(compare.hf_ttft_p50_s), "ttft_p95_s": _round(compare.hf_ttft_p95_s),
            "peak_rss_bytes": hf.peak_rss_bytes, "peak_gpu_bytes": hf.peak_gpu_bytes,
        },
        "ratios": {
            "output_tokens_per_s": _ratio(summary.output_tokens_per_s, compare.hf_output_tokens_per_s),
            "ttft_p50_s": _ratio(summary.ttft_p50_s, compare.hf_ttft_p50_s),
            "ttft_p95_s": _ratio(summary.ttft_p95_s, compare.hf_ttft_p95_s),
            "peak_rss_bytes": _ratio(summary.peak_rss_bytes, hf.peak_rss_bytes),
            "peak_gpu_bytes": _ratio(summary.peak_gpu_bytes, hf.peak_gpu_bytes),
        },
        "agreement": {
            "num_requests": agreement.num_requests, "num_identical": agreement.num_identical,
            "all_identical": agreement.num_identical == agreement.num_requests,
            "differences": [{"id": k, "first_difference": v} for k, v in agreement.first_difference.items()],
        },
    }


def write_json(document: dict[str, Any], path: str) -> None:
    text = json.dumps(document, indent=2) + "\n"
    if path == "-":
        print(text, end="")
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise PagecliError(f"Cannot write the JSON report to '{path}': {exc.strerror or exc}.") from None
