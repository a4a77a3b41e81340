"""One engine step packed on the host: the boundary between the model runner's packing and what
turns it into device tensors (the eager path in ``model_runner``, the static buffers in
``cuda_graphs``), and the byte packing that sends a step's arrays in one copy. Numpy arrays and
plain ints: each step's per-token inputs are computed with
array operations, and block tables are rows of the persistent batch (``persistent_batch``), not
lists rebuilt every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from batchery.engine.sequence import Sequence


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


# A host array's place in one byte buffer: (byte offset, bytes, dtype, shape).
Segment = tuple[int, int, np.dtype, tuple[int, ...]]


def pack_arrays(arrays: list[np.ndarray], out: np.ndarray | None = None) -> tuple[np.ndarray, list[Segment]]:
    """``arrays`` one after another in one uint8 buffer (``out`` if given, at least
    ``packed_nbytes(arrays)`` long), each at an 8-byte aligned offset, so that one copy moves all of
    them and each can be viewed in its own dtype on the other side (``unpack_segments``)."""
    if out is None:
        out = np.empty(packed_nbytes(arrays), dtype=np.uint8)
    segments: list[Segment] = []
    off = 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        out[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
        segments.append((off, a.nbytes, a.dtype, a.shape))
        off += (a.nbytes + 7) & ~7
    return out, segments


def packed_nbytes(arrays: list[np.ndarray]) -> int:
    return sum((a.nbytes + 7) & ~7 for a in arrays)


_TORCH_DTYPE = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.float32): torch.float32,
}


def unpack_segments(whole: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor]:
    """Views of the uint8 tensor ``whole`` (a copy of a ``pack_arrays`` buffer, on any device) as
    the arrays that were packed, each in its dtype and shape."""
    return [whole[off : off + n].view(_TORCH_DTYPE[dtype]).view(shape) for off, n, dtype, shape in segments]


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
