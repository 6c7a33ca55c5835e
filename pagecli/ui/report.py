"""Rich views of `bench` results: memory tables, the run report, the transformers comparison, sparklines.

Every view is built from the plain data the bench package computed (MemoryReport, RunSummary,
Comparison, the timeline's block counts); nothing here computes engine state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from pagecli.bench.units import format_bytes

if TYPE_CHECKING:
    from pagecli.bench.compare_hf import Comparison
    from pagecli.bench.memory import MemoryReport
    from pagecli.bench.model_info import AdapterMemory, ModelKV
    from pagecli.bench.summary import RunSummary

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
STATE_COLOURS = {"active": "green", "cached": "blue", "free": "grey50", "shared": "magenta"}
MAX_REQUEST_ROWS = 20


def sparkline(values: Sequence[float], width: int = 60, top: float | None = None) -> str:
    """One character per column; a column stands for consecutive values and shows their largest."""
    if not values:
        return ""
    group = max(1, -(-len(values) // width))
    columns = [max(values[i : i + group]) for i in range(0, len(values), group)]
    top = max(columns) if top is None else top
    if top <= 0:
        return SPARK_LEVELS[0] * len(columns)
    last = len(SPARK_LEVELS) - 1
    return "".join(SPARK_LEVELS[min(last, max(0, round(v / top * last)))] for v in columns)


def _int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _table(title: str, *columns: str, notes: bool = False) -> Table:
    """First column: labels; then right-aligned figures; with `notes`, a last left-aligned column of prose."""
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for i, name in enumerate(columns):
        is_note = notes and i == len(columns) - 1
        table.add_column(name, justify="left" if i == 0 or is_note else "right", no_wrap=i == 0)
    return table


# --- bench memory -------------------------------------------------------------------------------


def memory_view(report: MemoryReport, model: ModelKV | None,
                other: tuple[str, MemoryReport] | None = None,
                adapters: Sequence[AdapterMemory] = ()) -> RenderableType:
    """`other`: the same requests with the KV cache in another format (--kv-dtype): bytes columns beside;
    adapters: --lora's adapters' bytes."""
    parts: list[RenderableType] = [_memory_heading(report, model)]
    if adapters:
        each = ", ".join(f"{a.name} (rank {a.rank}) {format_bytes(a.nbytes)}" for a in adapters)
        parts.append(Text(f"LoRA adapters: {each}; {format_bytes(sum(a.nbytes for a in adapters))} in all, outside "
                          "the KV pool (its size does not change with them); a loaded adapter is also copied into "
                          "the stacks that batch its rows, so it holds about twice this in memory.\n"))
    if other is not None:
        parts.append(Text(f"--kv-dtype {other[0]}: {other[1].kv_bytes_per_token:,} KV bytes per token "
                          f"({_ratio_text(report.kv_bytes_per_token, other[1].kv_bytes_per_token)} the tokens "
                          f"in the same memory)\n"))
    if report.num_requests <= MAX_REQUEST_ROWS:
        parts.append(_request_table(report))
    parts.append(_totals_table(report, other))
    parts.append(_memory_notes(report))
    return Group(*parts)


def _memory_heading(report: MemoryReport, model: ModelKV | None) -> Text:
    lengths = sorted(report.lengths)
    text = Text.from_markup(
        f"[bold]{report.num_requests} requests[/], lengths {lengths[0]:,}..{lengths[-1]:,} "
        f"(median {lengths[len(lengths) // 2]:,}), contiguous reservation at max-len {report.max_len:,}\n"
    )
    if model is not None:
        text.append(f"{model.name}: {model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim} "
                    f"head dim x 2 (K, V) x {model.dtype_bytes} B ({model.dtype}) = ")
    if report.kv_bytes_per_token is not None:
        text.append(f"{report.kv_bytes_per_token:,} KV bytes per token\n")
    else:
        text.append("No model named: figures in token slots (name --model or give --kv-bytes-per-token for bytes)\n",
                    style="dim")
    return text


def _request_table(report: MemoryReport) -> Table:
    columns = ["length", "contig. waste"]
    for p in report.paged:
        columns += [f"b{p.block_size} held", f"b{p.block_size} waste"]
    table = _table(f"Per request, in token slots (contiguous holds {report.max_len:,} each; bN: paged, block size N)",
                   *columns)
    for i, length in enumerate(report.lengths):
        row = [f"{length:,}", f"{report.max_len - length:,}"]
        for p in report.paged:
            row += [f"{p.requests[i].paged_allocated_slots:,}", f"{p.requests[i].paged_wasted_slots:,}"]
        table.add_row(*row)
    return table


def _ratio_text(ours: int | None, theirs: int | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def _totals_table(report: MemoryReport, other: tuple[str, MemoryReport] | None = None) -> Table:
    """Slot rows are the same in any KV format; with `other`, its bytes and fits come in columns of their own."""
    c = report.contiguous
    extra = [] if other is None else [f"b{p.block_size} {other[0]}" for p in other[1].paged]
    table = _table("All requests (bN: paged, block size N)", "", "contiguous",
                   *(f"b{p.block_size}" for p in report.paged), *extra)
    for column in table.columns[2:]:
        column.style = "green"
    alt = [] if other is None else list(other[1].paged)

    def row(name: str, contiguous: str, paged: list[str], alt_paged: list[str] | None = None) -> None:
        table.add_row(name, contiguous, *paged, *(alt_paged if alt_paged is not None else ["" for _ in alt]))

    held = "slots held, unshared" if report.shared_prefix_tokens else "slots held"
    row(held, _int(c.reserved_slots), [_int(p.allocated_slots) for p in report.paged])
    row("slots wasted", _int(c.wasted_slots), [_int(p.wasted_slots) for p in report.paged])
    row("waste share", _pct(c.waste_share), [_pct(p.waste_share) for p in report.paged])
    row("waste bound", "-", [_int(p.waste_bound_slots) for p in report.paged])
    row("blocks", "-", [_int(p.blocks) for p in report.paged])
    if report.shared_prefix_tokens:
        row("blocks saved by prefix", "-", [_int(p.blocks_saved_by_sharing) for p in report.paged])
        row("blocks, prefix shared", "-", [_int(p.blocks_with_sharing) for p in report.paged])
    if report.kv_bytes_per_token is not None:
        row("KV per block", "-", [_bytes(p.kv_bytes_per_block) for p in report.paged],
            [_bytes(p.kv_bytes_per_block) for p in alt])
        row("KV bytes", _bytes(c.reserved_bytes),
            [_bytes(p.bytes_with_sharing) for p in report.paged], [_bytes(p.bytes_with_sharing) for p in alt])
    if report.budget_bytes is not None:
        table.add_row(f"fit in {format_bytes(report.budget_bytes)}", _int(c.requests_fit),
                      *(_int(p.requests_fit) for p in report.paged), *(_int(p.requests_fit) for p in alt),
                      style="bold")
    return table


def _memory_notes(report: MemoryReport) -> Text:
    text = Text()
    n = report.num_requests
    for p in report.paged:
        share = p.allocated_slots / report.contiguous.reserved_slots
        text.append(f"Block {p.block_size}: paging holds {_pct(share)} of the slots contiguous reservation holds; "
                    f"it wastes at most {p.block_size - 1} per request ({p.waste_bound_slots:,} in all), "
                    f"here {p.wasted_slots:,}.\n")
    if report.shared_prefix_tokens:
        text.append(f"Shared prefix: its {report.shared_prefix_tokens:,} tokens' full blocks are stored once, not "
                    f"{n} times (its last partial block is not shared).\n", style="dim")
    if report.kv_bytes_per_token is not None and report.shared_prefix_tokens:
        text.append("KV bytes count the shared prefix once.\n", style="dim")
    if report.budget_bytes is not None:
        text.append("Fit: requests whose KV is held at once in the budget (paged: this mix in order, repeated).\n",
                    style="dim")
    return text


# --- bench run ----------------------------------------------------------------------------------


def run_view(summary: RunSummary, timeline: dict[str, Sequence[int]], num_blocks: int, block_size: int,
             kv_bytes_per_block: int, max_model_len: int, device: str, dtype: str, backend: str,
             sampling: str | None = None) -> RenderableType:
    heading = Text.from_markup(
        f"[bold]bench run {summary.workload}[/]: {summary.num_requests} requests, {summary.prompt_tokens:,} prompt "
        f"and {summary.output_tokens:,} output tokens; {summary.model} on {device} ({dtype}, {backend} attention)"
        + (f"; sampling: {sampling}" if sampling else "")
    )
    return Group(heading, _speed_table(summary), _pool_table(summary, timeline, num_blocks),
                 _run_memory_table(summary, num_blocks, block_size, kv_bytes_per_block, max_model_len),
                 _prefix_table(summary))


def _speed_table(s: RunSummary) -> Table:
    table = _table("Speed", "elapsed", "steps", "output tok/s", "TTFT p50", "TTFT p95")
    table.add_row(_seconds(s.elapsed_s), _int(s.steps), f"{s.output_tokens_per_s:,.1f}", _seconds(s.ttft_p50_s),
                  _seconds(s.ttft_p95_s))
    return table


def _pool_table(s: RunSummary, timeline: dict[str, Sequence[int]], num_blocks: int) -> Table:
    table = _table(f"KV blocks ({num_blocks:,} in the pool), sampled after every step", "state", "peak", "mean",
                   "over time (each row scaled to its peak)", notes=True)
    rows = [("active", s.blocks_active.peak, f"{s.blocks_active.mean:,.1f}"),
            ("cached", s.blocks_cached.peak, f"{s.blocks_cached.mean:,.1f}"),
            ("free", s.blocks_free.peak, f"{s.blocks_free.mean:,.1f}"),
            ("shared", s.blocks_shared_peak, "")]
    for state, peak, mean in rows:
        colour = STATE_COLOURS[state]
        table.add_row(Text(state, style=colour), f"{peak:,}", mean,
                      Text(sparkline(timeline.get(state, ())), style=colour))
    return table


def _run_memory_table(s: RunSummary, num_blocks: int, block_size: int, kv_bytes_per_block: int,
                      max_model_len: int) -> Table:
    table = _table("Memory", "figure", "value", "", notes=True)
    table.add_row("KV pool", _bytes(num_blocks * kv_bytes_per_block),
                  f"{num_blocks:,} blocks x {format_bytes(kv_bytes_per_block)} ({block_size} tokens)")
    table.add_row("KV in active blocks, peak", _bytes(s.kv_bytes_active_peak),
                  f"{s.blocks_active.peak:,} blocks; with cached prefixes {format_bytes(s.kv_bytes_used_peak)}")
    table.add_row("internal fragmentation", f"{s.slots_unused.peak:,} slots peak",
                  f"mean {s.slots_unused.mean:,.1f} slots, {_pct(s.slots_unused_share_mean)} of active slots")
    times = s.contiguous_over_paged
    table.add_row("contiguous reservation would need", _bytes(s.contiguous_kv_bytes),
                  f"{s.peak_concurrency} running at once x {max_model_len:,} tokens (max_model_len)"
                  + (f" = {times:,.1f}x paging's peak" if times else ""),
                  style="bold")
    table.add_row("peak RSS (process)", _bytes(s.peak_rss_bytes), "weights + KV pool + activations + Python")
    if s.peak_gpu_bytes is not None:
        table.add_row("peak GPU memory allocated", _bytes(s.peak_gpu_bytes), "")
    return table


def _prefix_table(s: RunSummary) -> Table:
    table = _table("Prefix cache and scheduling", "figure", "value", "", notes=True)
    table.add_row("prefix hit rate, memory tier", _pct(s.prefix_hit_rate),
                  f"{s.prefix_hit_tokens:,} of {s.prefix_query_tokens:,} prompt tokens served from cache")
    table.add_row("prefix hit rate, disk tier", _pct(s.prefix_disk_hit_rate), f"{s.prefix_disk_hit_tokens:,} tokens")
    table.add_row("blocks saved by sharing, peak", _int(s.blocks_saved_by_sharing_peak),
                  "block-table entries pointing at a block another sequence also holds")
    table.add_row("preemptions", _int(s.num_preemptions), "")
    return table


def comparison_view(summary: RunSummary, compare: Comparison) -> RenderableType:
    hf = compare.hf
    table = _table(f"pagecli vs transformers {hf.transformers_version} generate (batches of {hf.batch_size}, greedy)",
                   "figure", "pagecli", "transformers", "pagecli / transformers", "better")
    rows = [
        ("output tok/s", summary.output_tokens_per_s, compare.hf_output_tokens_per_s, lambda v: f"{v:,.1f}", "higher"),
        ("TTFT p50", summary.ttft_p50_s, compare.hf_ttft_p50_s, _seconds, "lower"),
        ("TTFT p95", summary.ttft_p95_s, compare.hf_ttft_p95_s, _seconds, "lower"),
        ("elapsed", summary.elapsed_s, hf.elapsed_s, _seconds, "lower"),
        ("peak RSS", summary.peak_rss_bytes, hf.peak_rss_bytes, _bytes, "lower"),
    ]
    if summary.peak_gpu_bytes is not None:
        rows.append(("peak GPU memory", summary.peak_gpu_bytes, hf.peak_gpu_bytes, _bytes, "lower"))
    for name, ours, theirs, show, better in rows:
        ratio = f"{ours / theirs:,.2f}x" if ours is not None and theirs else "-"
        table.add_row(name, show(ours) if ours is not None else "-", show(theirs) if theirs is not None else "-",
                      ratio, better)
    agreement = compare.agreement
    if agreement.num_identical == agreement.num_requests:
        verdict = Text(f"Greedy outputs agree: {agreement.num_identical} of {agreement.num_requests} identical.",
                       style="green")
    else:
        shown = ", ".join(f"{k} at token {v}" for k, v in list(agreement.first_difference.items())[:5])
        verdict = Text(f"Greedy outputs: {agreement.num_identical} of {agreement.num_requests} identical; first "
                       f"differences: {shown}. (Different kernels round differently; near-ties can flip.)",
                       style="yellow")
    return Group(table, verdict)


def print_view(view: RenderableType, console: Console | None = None) -> None:
    (console or Console(highlight=False)).print(view)
