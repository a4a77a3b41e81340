"""Triton attention over the paged KV cache: the GPU path (and the CPU under TRITON_INTERPRET=1).

Decode rows go through the split-K paged decode kernel, prefill chunks through one varlen launch
over block tables; both read K/V only from the cache, so a cached prefix costs nothing extra."""

from __future__ import annotations

import torch

from batchery.engine.attention.metadata import AttentionMetadata
from batchery.engine.attention.triton_attention import paged_decode_attention, paged_prefill_attention, store_kvcache


def add_metadata(md: AttentionMetadata, prefills: list[tuple[int, int, list[int]]], device: torch.device) -> None:
    """Int32 views of the step's tables, built once per step rather than once per layer.
    ``prefills``: (query length, context length, block table) of each prefill chunk, in batch order."""
    if md.decode_block_tables is not None:
        md.decode_block_tables = md.decode_block_tables.int()
        md.decode_context_lens = md.decode_context_lens.int()
    if not prefills:
        return
    cu = [0]
    for n, _, _ in prefills:
        cu.append(cu[-1] + n)
    width = max(len(t) for _, _, t in prefills)
    md.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    md.prefill_context_lens = torch.tensor([c for _, c, _ in prefills], dtype=torch.int32, device=device)
    md.prefill_block_tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in prefills],
                                           dtype=torch.int32, device=device)
    md.prefill_max_q = max(n for n, _, _ in prefills)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                    sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Stores K/V, returns [T, H, D]."""
    store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
    nd = md.num_decode_tokens
    if md.prefill_cu_seqlens_q is None:
        return paged_decode_attention(q, k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                                      scale, sliding_window, softcap)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, md.decode_block_tables,
                                          md.decode_context_lens, scale, sliding_window, softcap)
    out[nd:] = paged_prefill_attention(q[nd:], k_cache, v_cache, md.prefill_block_tables,
                                       md.prefill_cu_seqlens_q, md.prefill_context_lens, scale,
                                       sliding_window, softcap, max_seqlen_q=md.prefill_max_q)
    return out
