"""The block tables of the sequences in flight, kept from step to step (vLLM v1's persistent batch).

Rebuilding every step's block tables from the sequences' lists costs a pass over every block of
every sequence; but from one step to the next, a decoding sequence's table is the same list, at
most one block longer. So each sequence keeps a row of one host array ``tables``
[max_rows, max_blocks], and a step writes only what changed: the new tail of a table that grew,
the whole row of a sequence that is new here or whose table was replaced. Steps then gather their
rows (``tables[rows, :width]``) in one numpy operation.

What a change is relies on how the block manager edits tables (``engine/block_manager.py``): a
table only grows by appending, or is replaced by another list (a preempted or finished sequence
gets a new empty list, a fork a copy of its parent's prefix); entries are never rewritten in place.
A row remembers the very list object it was synced from (holding it, so its ``id`` cannot be
reused) and how many of its entries it holds: a different object means a new table, a longer one
means new blocks.

Rows are not released when a sequence finishes (the batch is not told): when none is free, every
row that the current step does not use is released at once. A step uses at most ``max_num_seqs``
rows and there are twice as many, so such a sweep frees at least half of them. Pure numpy, no torch."""

from __future__ import annotations

import numpy as np

from batchery.engine.sequence import Sequence


class PersistentBatch:
    """Block-table rows for up to ``max_rows`` sequences, ``max_blocks`` wide, of ``dtype``
    (int64 for the torch and CPU attention backends, int32 for Triton). Entries past a table's
    length are 0, as in a zero-padded rebuild."""

    def __init__(self, max_num_seqs: int, max_blocks: int, dtype: type[np.integer] = np.int64) -> None:
        if max_num_seqs < 1 or max_blocks < 1:
            raise ValueError("max_num_seqs and max_blocks must be >= 1")
        self.max_rows = 2 * max_num_seqs
        self.max_blocks = max_blocks
        self.tables = np.zeros((self.max_rows, max_blocks), dtype=dtype)  # [max_rows, max_blocks]
        self.num_blocks = np.zeros(self.max_rows, dtype=np.int64)  # [max_rows] entries of each row in use
        self.row_of: dict[Sequence, int] = {}  # sequence -> its row
        # per row: the list it was synced from (None: free), and how many of its entries the row holds
        self.synced_list: list[list[int] | None] = [None] * self.max_rows
        self.synced_len: list[int] = [0] * self.max_rows
        self.owner: list[Sequence | None] = [None] * self.max_rows
        self.free_rows: list[int] = list(range(self.max_rows - 1, -1, -1))  # popped from the end: row 0 first
        # per row: the step that last used it (a list: written for every sequence of every step, and a
        # list item is several times cheaper to set than a numpy element)
        self.last_step: list[int] = [-1] * self.max_rows
        self.step = 0
        self.num_row_writes = 0  # whole rows written (new or replaced tables)
        self.num_tail_writes = 0  # rows that got new blocks appended

    def begin_step(self) -> None:
        """Start a step: the rows ``row`` returns from here on are the ones it uses."""
        self.step += 1

    def row(self, seq: Sequence) -> int:
        """``seq``'s row, synced with its block table (a new row if it has none)."""
        r = self.row_of.get(seq)
        table = seq.block_table
        if r is not None and self.synced_list[r] is table and self.synced_len[r] == len(table):
            self.last_step[r] = self.step
            return r
        return self.sync(seq)

    def sync(self, seq: Sequence) -> int:
        """Bring ``seq``'s row up to date with its block table; returns the row."""
        table = seq.block_table
        n = len(table)
        if n > self.max_blocks:
            raise ValueError(f"a block table of {n} blocks does not fit rows of {self.max_blocks}")
        r = self.row_of.get(seq)
        if r is None:
            r = self._new_row(seq)
        old = self.synced_len[r]
        if self.synced_list[r] is table and n >= old:
            self.tables[r, old:n] = table[old:n]
            self.num_tail_writes += 1
        else:
            self.tables[r, :n] = table
            if old > n:
                self.tables[r, n:old] = 0
            self.num_row_writes += 1
        self.synced_list[r] = table
        self.synced_len[r] = n
        self.num_blocks[r] = n
        # a sequence is used by the step that syncs it: a sweep during this step must not free its row
        self.last_step[r] = self.step
        return r

    def _new_row(self, seq: Sequence) -> int:
        if not self.free_rows:
            self._sweep()
        r = self.free_rows.pop()
        self.row_of[seq] = r
        self.owner[r] = seq
        return r

    def _sweep(self) -> None:
        """Release every row the current step has not used (their sequences finished, were
        aborted, or simply sit this step out; a row is rebuilt when its sequence comes back)."""
        step = self.step
        for r, used in enumerate(self.last_step):
            if used != step:
                self.release_row(r)
        if not self.free_rows:
            raise RuntimeError(f"more than {self.max_rows} sequences in one step")

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s row now, if it has one."""
        r = self.row_of.get(seq)
        if r is not None:
            self.release_row(r)

    def release_row(self, r: int) -> None:
        seq = self.owner[r]
        if seq is None:
            return
        del self.row_of[seq]
        self.owner[r] = None
        self.tables[r, : self.synced_len[r]] = 0
        self.synced_list[r] = None
        self.synced_len[r] = 0
        self.num_blocks[r] = 0
        self.last_step[r] = -1
        self.free_rows.append(r)

    def gather(self, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        """The tables of ``rows`` as a new [len(rows), width] array, zero-padded; ``width``
        defaults to the longest of them (at least 1)."""
        if width is None:
            width = max(int(self.num_blocks[rows].max()), 1) if len(rows) else 1
        return self.tables[rows, :width]
