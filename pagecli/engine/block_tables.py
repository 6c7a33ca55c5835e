"""The block tables a step's attention reads, kept between steps instead of rebuilt from lists.

Each sequence that runs holds a row of a host table made once (grown by doubling when more rows or
wider rows are needed, which is rare): `rows[r, :n]` is the block table it had when its row was last
written, and a row is written only where its sequence's table changed (a decode step writes one id
when a sequence gains a block, none otherwise). A step's [num_seqs, width] table is one gather of its
sequences' rows; on a GPU, into a pinned buffer copied to the device once per step. When a step runs
the same sequences in the same order as the last one (steady decode), the last step's table is
returned again, its rows' changes written into it too: no tensor operation at all, which matters on
a CPU, where the first use of each tensor operation after a forward costs tens of microseconds (its
code and data evicted by the forward: measured 70 us for the first torch.tensor of a step, 10 for the
next). Rows are written through NumPy views of the tensors' memory for the same reason.

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
        self._table_view = self.table.numpy()  # the same memory
        self._row_of: dict[int, int] = {}  # id(seq) -> row
        # The last step's batch: its rows, its table (on the device) and the host copy writes also go to.
        self._last_rows: list[int] | None = None
        self._last_batch: torch.Tensor | None = None
        self._last_view = None
        self._changed: list[int] = []  # rows written during this gather
        self._written: list[list[int] | None] = [None] * rows  # row -> the table its row holds
        self._free = list(range(rows - 1, -1, -1))
        self.rows_written = 0  # ids written, for tests and the host benchmark

    def gather(self, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """The step's block tables in `seqs`' order: [len(seqs), widest table] int32 on the device, padded
        with 0 (reads past a sequence's length are masked)."""
        width = max((len(seq.block_table) for seq in seqs), default=0) or 1
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], max(width, 2 * self.table.shape[1]))
        row_of, written = self._row_of, self._written
        rows = []
        self._changed = []
        for seq in seqs:
            row = row_of.get(id(seq))
            if row is None or written[row] != seq.block_table:  # most steps: the row already agrees
                row = self._row_for(seq, seqs)
            rows.append(row)
        last = self._last_batch
        if rows == self._last_rows and last is not None and last.shape[1] == width:
            if not self._changed:
                return last
            if self.device.type == "cpu":  # the last table is the host copy: put the changed rows in it
                for row in set(self._changed):
                    self._last_view[rows.index(row)] = self._table_view[row, :width]
                return last
        index = torch.tensor(rows, dtype=torch.long)
        batch = self.table[:, :width].index_select(0, index)  # [num_seqs, width]
        self._last_rows = rows
        if self.device.type == "cpu":
            self._last_batch, self._last_view = batch, batch.numpy()
            return batch
        if self._pinned:
            batch = batch.pin_memory()
        self._last_batch = batch.to(self.device, non_blocking=True)
        return self._last_batch

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
            self._table_view[row, start : len(table)] = table[start:]
            self.rows_written += len(table) - start
        written = self._written[row]
        if written is not None and len(written) > len(table):
            self._table_view[row, len(table) : len(written)] = 0  # a shorter table: its padding is 0, as rebuilt
        self._written[row] = list(table)
        self._changed.append(row)

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
                    self._table_view[row, : len(written)] = 0
                self._written[row] = None
                self._free.append(row)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        # A plain tensor even when a step grows it under inference mode, so later writes from outside it work.
        with torch.inference_mode(False):
            table = torch.zeros(rows, width, dtype=torch.int32, pin_memory=self._pinned)
            table[:old_rows, :old_width] = self.table
        self.table = table
        self._table_view = table.numpy()
        self._written.extend([None] * (rows - old_rows))
        self._free = list(range(rows - 1, old_rows - 1, -1)) + self._free
