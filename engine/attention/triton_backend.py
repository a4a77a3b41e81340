"""Triton attention over the paged KV cache: the GPU path (and the CPU under TRITON_INTERPRET=1).

Decode rows go through the split-K paged decode kernel, prefill chunks through one varlen launch
over block tables; both read K/V only from the cache, so a cached prefix costs nothing extra."""

from __future__ import annotations

import numpy as np
import torch

from batchery.engine.attention.metadata import AttentionMetadata
from batchery.engine.attention.triton_attention import paged_decode_attention, paged_prefill_attention, store_kvcache
from batchery.engine.packed_step import PackedPrefill


def prefill_arrays(prefills: list[PackedPrefill]) -> tuple[np.ndarray, np.ndarray, int]:
    """The varlen description of the step's prefill chunks (in batch order), on the host, int32 as
    the kernel reads them: cumulative query lengths [num_prefills + 1], context lengths
    [num_prefills], and the longest query. The model runner sends them with the step's other inputs
    in one copy; the block tables come from the persistent batch."""
    q_lens = np.fromiter((pf.q_len for pf in prefills), dtype=np.int32, count=len(prefills))
    cu = np.zeros(len(prefills) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    ctx = np.fromiter((pf.context_len for pf in prefills), dtype=np.int32, count=len(prefills))
    return cu, ctx, int(q_lens.max())


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Stores K/V, returns [T, H, D]."""
    store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
    nd = md.num_decode_tokens
    bt, lens = md.decode_block_tables, md.decode_context_lens
    if md.prefill_cu_seqlens_q is None:  # decode only
        assert bt is not None and lens is not None
        return paged_decode_attention(q, k_cache, v_cache, bt, lens, scale, sliding_window, softcap)
    out = torch.empty_like(q)
    if nd:
        assert bt is not None and lens is not None
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, bt, lens, scale, sliding_window, softcap)
    assert md.prefill_block_tables is not None and md.prefill_context_lens is not None  # set by add_metadata
    out[nd:] = paged_prefill_attention(
        q[nd:],
        k_cache,
        v_cache,
        md.prefill_block_tables,
        md.prefill_cu_seqlens_q,
        md.prefill_context_lens,
        scale,
        sliding_window,
        softcap,
        max_seqlen_q=md.prefill_max_q,
    )
    return out
