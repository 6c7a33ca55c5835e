"""The block tables a step's attention reads, kept between steps instead of rebuilt from lists.

Each sequence that runs holds a row of a host table made once (grown by doubling when more rows or
wider rows are needed, which is rare): `rows[r, :n]` is the block table it had when its row was last
written, and a row is written only where its sequence's table changed (a decode step writes one id
when a sequence gains a block, none otherwise). A step's [num_seqs, width] table is one gather of its
sequences' rows; on a GPU, into a pinned buffer copied to the device once per step.

Invariant: for every sequence with a row, `written` holds exactly what its row holds; a sequence's row
is checked against its current table at every step it runs (a copy-on-write, a preemption, a beam
reordering or a prefix hit changes it, and the row is rewritten from the first id that differs), so a
row never disagrees with the table the scheduler gave. A sequence that stops running keeps its row
until the rows run out; then the rows of the sequences not in the step are given back.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from pagecli.engine.sequence import Sequence


class KeptBlockTables:
    def __init__(self, device: torch.device, rows: int = 64, width: int = 16) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self._pinned = pinned
        self.table = torch.zeros(rows, width, dtype=torch.int32, pin_memory=pinned)  # [rows, width] host
        self._row_of: dict[int, int] = {}  # id(seq) -> row
        self._written: list[list[int] | None] = [None] * rows  # row -> the table its row holds
        self._free = list(range(rows - 1, -1, -1))
        self.rows_written = 0  # ids written, for tests and the host benchmark

    def gather(self, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """The step's block tables in `seqs`' order: [len(seqs), widest table] int32 on the device, padded
        with 0 (reads past a sequence's length are masked)."""
        width = max((len(seq.block_table) for seq in seqs), default=0) or 1
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], max(width, 2 * self.table.shape[1]))
        rows = [self._row_for(seq, seqs) for seq in seqs]
        index = torch.tensor(rows, dtype=torch.long)
        batch = self.table[:, :width].index_select(0, index)  # [num_seqs, width]
        if self.device.type == "cpu":
            return batch
        if self._pinned:
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def _row_for(self, seq: Sequence, step: SequenceOf[Sequence]) -> int:
        table = seq.block_table
        row = self._row_of.get(id(seq))
        if row is None or self._written[row] is None:
            row = self._take_row(seq, step)
            self._write(row, table, 0)
            return row
        written = self._written[row]
        if len(table) >= len(written) and table[: len(written)] == written:
            if len(table) > len(written):
                self._write(row, table, len(written))  # a decode step's new block: the tail only
            return row
        first = next((i for i, (a, b) in enumerate(zip(table, written)) if a != b), min(len(table), len(written)))
        self._write(row, table, first)
        return row

    def _write(self, row: int, table: list[int], start: int) -> None:
        """Row `row` := table, rewriting from position `start` (what lies before it already agrees)."""
        if len(table) > start:
            self.table[row, start : len(table)] = torch.tensor(table[start:], dtype=torch.int32)
            self.rows_written += len(table) - start
        written = self._written[row]
        if written is not None and len(written) > len(table):
            self.table[row, len(table) : len(written)] = 0  # a shorter table: its padding is 0, as rebuilt
        self._written[row] = list(table)

    def _take_row(self, seq: Sequence, step: SequenceOf[Sequence]) -> int:
        if not self._free:
            self._release_all_but(step)
        if not self._free:
            old = self.table.shape[0]
            self._grow(2 * old, self.table.shape[1])
        row = self._free.pop()
        self._row_of[id(seq)] = row
        return row

    def _release_all_but(self, step: SequenceOf[Sequence]) -> None:
        """Give back the rows of the sequences not in this step (finished, preempted or waiting: a
        sequence that runs again gets a row and has it written whole)."""
        keep = {id(seq) for seq in step}
        for key, row in list(self._row_of.items()):
            if key not in keep:
                del self._row_of[key]
                written = self._written[row]
                if written:
                    self.table[row, : len(written)] = 0
                self._written[row] = None
                self._free.append(row)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        # A plain tensor even when a step grows it under inference mode, so later writes from outside it work.
        with torch.inference_mode(False):
            table = torch.zeros(rows, width, dtype=torch.int32, pin_memory=self._pinned)
            table[:old_rows, :old_width] = self.table
        self.table = table
        self._written.extend([None] * (rows - old_rows))
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
