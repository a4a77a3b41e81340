"""Triton attention over the paged KV cache: the GPU path (and the CPU under TRITON_INTERPRET=1).

Decode rows go through the split-K paged decode kernel, prefill chunks through one varlen launch
over block tables; both read K/V only from the cache, so a cached prefix costs nothing extra."""

from __future__ import annotations

import torch

from batchery.engine.attention.metadata import AttentionMetadata
from batchery.engine.attention.triton_attention import paged_decode_attention, paged_prefill_attention, store_kvcache
from batchery.engine.packed_step import PackedPrefill


def add_metadata(md: AttentionMetadata, prefills: list[PackedPrefill], device: torch.device) -> None:
    """Int32 views of the step's tables, built once per step rather than once per layer.
    ``prefills``: the step's prefill chunks, in batch order."""
    if md.decode_block_tables is not None:
        assert md.decode_context_lens is not None  # set together with the decode tables
        md.decode_block_tables = md.decode_block_tables.int()
        md.decode_context_lens = md.decode_context_lens.int()
    if not prefills:
        return
    cu = [0]
    for pf in prefills:
        cu.append(cu[-1] + pf.q_len)
    width = max(len(pf.block_table) for pf in prefills)
    md.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    md.prefill_context_lens = torch.tensor([pf.context_len for pf in prefills], dtype=torch.int32, device=device)
    md.prefill_block_tables = torch.tensor(
        [pf.block_table + [0] * (width - len(pf.block_table)) for pf in prefills], dtype=torch.int32, device=device
    )
    md.prefill_max_q = max(pf.q_len for pf in prefills)


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
