"""The `bench memory --forks` table: KV blocks with block sharing against per-candidate copies, measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

if TYPE_CHECKING:
    from pagecli.bench.sharing import SharingFigures


def sharing_view(figures: Sequence[SharingFigures], block_size: int) -> Table:
    table = Table(title=f"Block sharing, measured: KV blocks held with sharing against per-candidate copies "
                        f"(block size {block_size}; summed over every step; peak: shared / copies)",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for column in ("scenario", "width", "requests", "shared", "copies", "peak", "KV saved"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for f in figures:
        table.add_row(f.scenario, str(f.width), f"{f.prompts} x {f.output_tokens} tok", f"{f.block_steps_shared:,}",
                      f"{f.block_steps_copies:,}", f"{f.peak_blocks_shared:,} / {f.peak_blocks_copies:,}",
                      f"{f.saved_share:.1%}")
    return table
