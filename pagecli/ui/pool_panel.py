"""The block-pool panel: a map of the KV pool and its figures, drawn from one EngineStats snapshot.

Every figure here is read from the snapshot (and the turn's TurnStats, itself a difference of
two snapshots); nothing is counted again. Each map cell is one block, or a group of
consecutive blocks when the pool is too big to draw, coloured by the most significant state present
in the group (shared > active > cached > free), so a few busy blocks among many free ones still show.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.panel import Panel
from rich.text import Text

from pagecli.chat.turn import TurnStats
from pagecli.engine.stats import EngineStats
from pagecli.ui.progress import adapter_text

# Drawing order is also the significance order: a grouped cell shows the first of these it holds.
STATE_STYLES: dict[str, tuple[str, str]] = {
    "shared": ("▓", "bold magenta"),
    "active": ("█", "green"),
    "cached": ("▒", "blue"),
    "free": ("·", "grey50"),
}
CELLS_PER_ROW = 64
MAX_ROWS = 4


def format_bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _percent(part: int, total: int) -> str:
    return f"{100 * part / total:.1f}%" if total else "0.0%"


def group_states(states: Sequence[str], max_cells: int) -> tuple[list[str], int]:
    """One state per cell and how many blocks a cell stands for."""
    group = max(1, -(-len(states) // max_cells))
    if group == 1:
        return list(states), 1
    cells = []
    for start in range(0, len(states), group):
        present = set(states[start : start + group])
        cells.append(next(state for state in STATE_STYLES if state in present))
    return cells, group


def pool_map(states: Sequence[str], cells_per_row: int = CELLS_PER_ROW, max_rows: int = MAX_ROWS) -> Text:
    cells, group = group_states(states, cells_per_row * max_rows)
    text = Text()
    for row_start in range(0, len(cells), cells_per_row):
        if row_start:
            text.append("\n")
        row = cells[row_start : row_start + cells_per_row]
        run_start = 0
        for i in range(1, len(row) + 1):  # one styled span per run of equal cells: cheap to redraw
            if i == len(row) or row[i] != row[run_start]:
                glyph, style = STATE_STYLES[row[run_start]]
                text.append(glyph * (i - run_start), style=style)
                run_start = i
    legend = Text("\n")
    for state, (glyph, style) in STATE_STYLES.items():
        legend.append(glyph, style=style).append(f" {state}  ")
    legend.append(f"(1 cell = {group} block{'s' if group > 1 else ''})", style="dim")
    return text + legend


def occupancy_line(stats: EngineStats) -> Text:
    """The three states with counts and shares of the pool; shared blocks are a part of active."""
    total = stats.num_blocks
    line = Text()
    line.append(f"active {stats.blocks_active} ({_percent(stats.blocks_active, total)})", style="green")
    line.append(f", shared {stats.blocks_shared} ({_percent(stats.blocks_shared, total)})", style="magenta")
    line.append(" · ")
    line.append(f"cached {stats.blocks_cached} ({_percent(stats.blocks_cached, total)})", style="blue")
    line.append(f" · free {stats.blocks_free} ({_percent(stats.blocks_free, total)})")
    return line


def _kv_format(stats: EngineStats) -> str:
    """' int8' when the cache is not in the model's dtype (--kv-dtype), else nothing."""
    return f" {stats.kv_dtype}" if stats.kv_dtype and stats.kv_dtype != stats.dtype else ""


def memory_line(stats: EngineStats) -> Text:
    return Text(
        f"{stats.num_blocks} blocks × {stats.block_size} tokens · KV{_kv_format(stats)} "
        f"{format_bytes(stats.kv_bytes_used)} used of "
        f"{format_bytes(stats.kv_bytes_total)} ({_percent(stats.kv_bytes_used, stats.kv_bytes_total)}) · "
        f"{stats.tokens_that_fit:,} tokens still fit"
    )


def turn_line(turn: TurnStats) -> Text:
    ttft = f"{turn.ttft_s * 1000:.0f} ms" if turn.ttft_s is not None else "-"
    rate = f"{turn.decode_tokens_per_s:.1f} tok/s" if turn.decode_tokens_per_s is not None else "-"
    line = Text("turn: ", style="bold")
    line.append(f"prompt {turn.prompt_tokens} · cached {turn.cached_tokens} memory + {turn.cached_disk_tokens} disk"
                f" · prefilled {turn.prefilled_tokens} · TTFT {ttft} · decode {rate}")
    return line


def speculation_line(stats: EngineStats) -> Text:
    """How --speculate has done so far: drafts accepted, and tokens a checking pass gave."""
    method = f" ({stats.spec_method})" if stats.spec_method else ""
    return Text(f"speculation{method}: {stats.spec_acceptance:.0%} of {stats.spec_drafts:,} drafts accepted · "
                f"{stats.spec_tokens / stats.spec_passes:.2f} tokens a checking pass", style="magenta")


def pool_panel(stats: EngineStats, turn: TurnStats | None = None, cells_per_row: int = CELLS_PER_ROW,
               max_rows: int = MAX_ROWS) -> Panel:
    parts: list[Text] = []
    if stats.block_states is not None:
        parts.append(pool_map(stats.block_states, cells_per_row, max_rows))
    parts += [occupancy_line(stats), memory_line(stats)]
    if stats.adapter_requests:
        parts.append(Text(f"LoRA: {adapter_text(stats)}", style="cyan"))
    if stats.spec_passes:
        parts.append(speculation_line(stats))
    if turn is not None:
        parts.append(turn_line(turn))
    return Panel(Group(*parts), title="KV block pool", title_align="left", border_style="grey50", expand=False)
