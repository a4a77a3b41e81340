"""One engine step packed on the host: the boundary between the model runner's packing and what
turns it into device tensors (the eager path in ``model_runner``, the static buffers in
``cuda_graphs``). Numpy arrays and plain ints: each step's per-token inputs are computed with
array operations, and block tables are rows of the persistent batch (``persistent_batch``), not
lists rebuilt every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from batchery.engine.sequence import Sequence

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _empty() -> np.ndarray:
    return _EMPTY


class PackedPrefill(NamedTuple):
    """One prefill chunk of a packed step, on the host. ``attention.metadata.PrefillSeq`` is its
    device-side form for the torch backend (the block table as a tensor, or None)."""

    q_start: int  # offset of its first query token in the packed batch
    q_len: int  # tokens computed this step
    context_len: int  # tokens of context including the new ones
    block_table: list[int]  # the sequence's block table (the live list: read, never written)

    @property
    def has_prefix(self) -> bool:
        """Some of its context was computed before this step (an earlier chunk or a prefix-cache hit)."""
        return self.context_len > self.q_len


@dataclass
class PackedStep:
    """One step on the host, before it becomes device tensors. Decode tokens come first, then the
    prefill chunks, each sequence's tokens contiguous. The int arrays are int64 unless noted."""

    input_ids: np.ndarray = field(default_factory=_empty)  # [num_tokens] the tokens computed this step
    positions: np.ndarray = field(default_factory=_empty)  # [num_tokens] their positions in their sequence
    slots: np.ndarray = field(default_factory=_empty)  # [num_tokens] KV-cache slot each token's K/V goes to
    logits_idx: np.ndarray = field(default_factory=_empty)  # [num_sample] rows of the batch to sample from
    sample_seqs: list[Sequence] = field(default_factory=list)  # [num_sample] the sequences those rows sample for
    # the persistent batch's [max_rows, max_blocks] block tables (``PersistentBatch.tables``), which the
    # rows below index; entries past a table's length are 0
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.int64))
    decode_rows: np.ndarray = field(default_factory=_empty)  # [num_decode] each decode sequence's row
    decode_lens: np.ndarray = field(default_factory=_empty)  # [num_decode] their context lengths, new token included
    decode_width: int = 1  # the longest decode block table (at least 1)
    prefills: list[PackedPrefill] = field(default_factory=list)  # the prefill chunks, in batch order
    prefill_rows: np.ndarray = field(default_factory=_empty)  # [num_prefills] their rows in ``block_tables``
    prefill_width: int = 1  # the longest prefill block table (at least 1)

    @property
    def num_decode(self) -> int:
        return len(self.decode_rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def decode_tables(self) -> np.ndarray:
        """[num_decode, decode_width] the decode sequences' block tables, zero-padded (a new array)."""
        return self.block_tables[self.decode_rows, : self.decode_width]

    def prefill_tables(self) -> np.ndarray:
        """[num_prefills, prefill_width] the prefill chunks' block tables, zero-padded (a new array)."""
        return self.block_tables[self.prefill_rows, : self.prefill_width]
