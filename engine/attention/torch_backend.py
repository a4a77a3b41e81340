"""Torch reference attention over the paged KV cache: correct everywhere.

Decode sequences (one query token each) are attended in one batched call over their gathered
block tables; prefill chunks are attended one sequence at a time (there are few per step).
The "cpu" backend is this path with decode handed to the C++ kernel in ``cpu_paged`` and prefill
to the one in ``cpu_prefill``, which read the block pool directly instead of gathering a padded copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchery.engine.attention import cpu_paged, cpu_prefill
from batchery.engine.attention.metadata import AttentionMetadata, PrefillSeq


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # key/value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:
    """q: [B, H, Q, D]; k, v: [B, Hkv, C, D]; mask: bool [B, 1, Q, C] (True = attend) or None."""
    if not softcap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
        )
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (h // hkv) * nq, d)  # query heads grouped by their kv head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*Q, C]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, hkv, h // hkv, nq, -1)
    if is_causal:
        mask = torch.ones(nq, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - nq)[None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, -1, k.shape[2])
    return torch.matmul(probs, v).reshape(b, h, nq, d)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # [B, max_blocks] -> [B, num_kv_heads, max_blocks * block_size, head_dim]
    # index_select over whole blocks is several times faster on CPU than advanced indexing
    num_blocks, bs, hkv, d = cache.shape
    b, nb = block_tables.shape
    g = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    return g.view(b, nb * bs, hkv, d).transpose(1, 2)


def _decode_mask(md: AttentionMetadata, width: int, sliding_window: int | None) -> torch.Tensor:
    key = ("decode", width, sliding_window)
    mask = md.masks.get(key)
    if mask is None:
        ctx = md.decode_context_lens  # [B]; the query sits at position ctx - 1
        assert ctx is not None  # set whenever there are decode tokens
        pos = torch.arange(width, device=ctx.device)
        valid = pos[None, :] < ctx[:, None]
        if sliding_window:
            valid &= pos[None, :] > (ctx[:, None] - 1 - sliding_window)
        mask = md.masks[key] = valid[:, None, None, :]
    return mask


def _prefill_mask(md: AttentionMetadata, p: PrefillSeq, sliding_window: int | None) -> torch.Tensor:
    key = (p.q_start, sliding_window)
    mask = md.masks.get(key)
    if mask is None:
        qpos = torch.arange(p.context_len - p.q_len, p.context_len, device=md.slot_mapping.device)[:, None]
        kpos = torch.arange(p.context_len, device=md.slot_mapping.device)[None, :]
        m = kpos <= qpos
        if sliding_window:
            m &= kpos > qpos - sliding_window
        mask = md.masks[key] = m[None, None]  # [1, 1, Q, C]
    return mask


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
    """q: [T, H, D]; k, v: [T, Hkv, D] (already stored in the cache). Returns [T, H, D]."""
    nd = md.num_decode_tokens
    decoded = None  # [nd, H, D]
    if nd:
        bt, lens = md.decode_block_tables, md.decode_context_lens
        assert bt is not None and lens is not None  # set whenever there are decode tokens
        if md.backend == "cpu":
            decoded = cpu_paged.paged_decode(q[:nd], k_cache, v_cache, bt, lens, scale, sliding_window, softcap)
            if nd == q.shape[0] and not md.prefills:  # decodes only: the kernel's output as it is
                return decoded
        else:
            kc = _gather(k_cache, bt)  # [B, Hkv, C, D]
            vc = _gather(v_cache, bt)
            dmask = _decode_mask(md, kc.shape[2], sliding_window)  # [B, 1, 1, C], shared by all layers
            hkv = kc.shape[1]
            if softcap:
                o = _attend(q[:nd].unsqueeze(2), kc, vc, dmask, scale, softcap)  # [B, H, 1, D]
            else:
                # The query heads sharing a KV head act as that head's queries at one position, so one
                # SDPA call reads each KV head once instead of once per query head.
                qg = q[:nd].view(nd, hkv, -1, q.shape[-1])  # [B, Hkv, G, D]
                o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=dmask, scale=scale)
            decoded = o.reshape(nd, q.shape[1], q.shape[2])
    out = torch.empty_like(q)
    if decoded is not None:
        out[:nd] = decoded
    if md.prefills and md.backend == "cpu" and cpu_prefill.supports(q, softcap):
        # all of the step's chunks in one C++ call, K/V read from the pool (softcap and the rest: below)
        cpu_prefill.prefill_attention(q, k, v, k_cache, v_cache, md, out, scale, sliding_window)
        return out
    for p in md.prefills:
        qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if p.block_table is None:
            ks = k[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            vs = v[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
        else:
            ks = _gather(k_cache, p.block_table[None])[:, :, : p.context_len]
            vs = _gather(v_cache, p.block_table[None])[:, :, : p.context_len]
        mask = None
        if sliding_window or p.block_table is not None:
            mask = _prefill_mask(md, p, sliding_window)
        o = _attend(qs, ks, vs, mask, scale, softcap, is_causal=mask is None)
        out[p.q_start : p.q_start + p.q_len] = o[0].transpose(0, 1)
    return out
