"""Triton kernels for the paged KV cache, plus dense torch references.

Cache layout, one pair per layer: ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous. Slot ``s`` lives in block
``s // block_size`` at offset ``s % block_size``. Block tables are int32
``[num_seqs, max_blocks_per_seq]``, padded with 0 past each sequence's context.

Attention semantics shared by the kernels and the references:

- ``scores = (q . k) * scale``
- with ``softcap``: ``scores = softcap * tanh(scores / softcap)`` (Gemma-2)
- causal: a query at absolute position ``p`` sees keys ``k <= p``
- with ``sliding_window`` ``W`` (as in HF transformers): only keys with ``p - k < W``
- softmax in float32; the output has the query's dtype

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU tensors,
which is how the tests exercise them without a GPU. Importing this module only defines
functions and kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "store_kvcache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
]

_LOG2E = tl.constexpr(1.4426950408889634)
# Running max starts finite so fully masked rows never compute (-inf) - (-inf).
_NEG_BIG = tl.constexpr(-1.0e30)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
# Triton reads the annotations of a kernel's parameters as specialisation hints (``tl.constexpr``,
# forced types), so pointers, strides and sizes stay unannotated and each ``@triton.jit`` function
# carries ``type: ignore[no-untyped-def]``.


@triton.jit
def _store_kvcache_kernel(  # type: ignore[no-untyped-def]  # Triton kernel (see above)
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot == -1 marks a padding token: its store is fully masked.
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim) & (slot >= 0)

    k = tl.load(
        key_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :] * stride_k_dim,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :] * stride_v_dim,
        mask=mask,
    )
    safe_slot = tl.maximum(slot, 0)
    base = (safe_slot // block_size) * stride_c_blk + (safe_slot % block_size) * stride_c_off
    cache_offs = base + offs_h[:, None] * stride_c_head + offs_d[None, :] * stride_c_dim
    tl.store(k_cache_ptr + cache_offs, k, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v, mask=mask)


@triton.jit
def _softcap(s, softcap):  # type: ignore[no-untyped-def]  # Triton device function
    # tanh from exp(-2|x|): no overflow for large |x| and no tanh in core triton.language.
    x = s / softcap
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return softcap * tl.where(x < 0, -th, th)


@triton.jit
def _gather_kv_offsets(  # type: ignore[no-untyped-def]
    block_tables_ptr,
    bt_row,
    k_pos,
    n_mask,
    block_size,
    stride_c_blk,
    stride_c_off,
    kv_head_off,
):
    """Element offsets of the cache rows holding key positions ``k_pos`` ([BLOCK_N])."""
    blk = tl.load(block_tables_ptr + bt_row + k_pos // block_size, mask=n_mask, other=0)
    return blk.to(tl.int64) * stride_c_blk + (k_pos % block_size).to(tl.int64) * stride_c_off + kv_head_off


@triton.jit
def _decode_split_bounds(  # type: ignore[no-untyped-def]
    ctx,
    sliding_window,
    split,
    num_splits,
    HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key range ``[lo, hi)`` of partition ``split`` of one sequence, and how many partitions
    hold keys (``n_valid``).

    The partition size comes from the sequence's own attended span (its context, or its window),
    not from the block table's width: under CUDA graphs the table is ``max_model_len`` wide, and
    splitting that width would leave every partition but the first empty. ``num_splits`` stays a
    launch-time constant (the grid is shapes only, so graphs stay capturable); partitions at or
    past ``n_valid`` get an empty range. The decode and the reduce kernels both call this, so they
    agree on which partitions exist without the partitions having to say so in memory.
    """
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - sliding_window, 0)
    span = ctx - start
    # Whole BLOCK_N tiles per partition; at least one, so a span of 0 still divides.
    part = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N), 1) * BLOCK_N
    n_valid = tl.cdiv(span, part)
    lo = start + split * part
    hi = tl.minimum(lo + part, ctx)
    return lo, hi, n_valid


@triton.jit
def _paged_decode_kernel(  # type: ignore[no-untyped-def]  # Triton kernel (see above)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    scale,
    softcap,
    sliding_window,
    stride_q_seq,
    stride_q_head,
    stride_q_dim,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_p_dim,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    stride_bt_seq,
    num_queries_per_kv,
    num_heads,
    num_splits,
    head_dim,
    block_size,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (sequence, kv head[, context partition]); all query heads that share
    # the kv head are the rows of one tile, so each K/V row is read once per group.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * num_queries_per_kv + offs_g
    g_mask = offs_g < num_queries_per_kv
    d_mask = offs_d < head_dim

    if USE_SPLIT:
        lo, hi, n_valid = _decode_split_bounds(ctx, sliding_window, split, num_splits, HAS_WINDOW, BLOCK_N)
    else:
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx - sliding_window, 0)
        hi = ctx

    # An empty range (context 0, or a partition past the span) loads nothing, not even q.
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=g_mask[:, None] & d_mask[None, :] & (lo < hi),
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = seq * stride_bt_seq
    kv_head_off = kv_head.to(tl.int64) * stride_c_head
    qk_scale = scale * _LOG2E

    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        n_mask = k_pos < hi
        row_offs = _gather_kv_offsets(
            block_tables_ptr, bt_row, k_pos, n_mask, block_size, stride_c_blk, stride_c_off, kv_head_off
        )
        k = tl.load(
            k_cache_ptr + row_offs[None, :] + offs_d[:, None] * stride_c_dim,
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if HAS_SOFTCAP:
            s = _softcap(s * scale, softcap) * _LOG2E
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N], log2 units

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_cache_ptr + row_offs[:, None] + offs_d[None, :] * stride_c_dim,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty range (context 0) leaves l_i == 0: emit zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :] * stride_o_dim
    o_mask = g_mask[:, None] & d_mask[None, :]
    if USE_SPLIT:
        # A span that fits one partition (or is empty) is finished here by partition 0, in the
        # output dtype, and the reduce kernel skips the sequence; otherwise each partition that
        # holds keys leaves float32 partials. Partitions past the span write nothing at all.
        direct = (n_valid <= 1) & (split == 0)
        partial = (n_valid > 1) & (split < n_valid)
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask & direct)
        p_offs = seq * stride_p_seq + heads[:, None] * stride_p_head + offs_d[None, :] * stride_p_dim
        tl.store(part_out_ptr + p_offs + split * stride_p_split, out, mask=o_mask & partial)
        stat_offs = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + stat_offs, m_i, mask=g_mask & partial)
        tl.store(part_l_ptr + stat_offs, l_i, mask=g_mask & partial)
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton kernel (see above)
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    context_lens_ptr,
    out_ptr,
    sliding_window,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_p_dim,
    stride_o_seq,
    stride_o_head,
    stride_o_dim,
    num_heads,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Merges per-partition softmax results (flash-decoding) into the final output.

    Only the partitions that hold keys are read (the same bounds as the decode kernel, from the
    context length); a sequence whose span fitted one partition was finished by the decode
    kernel and is skipped, so its row of ``out`` is left as written."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    _lo, _hi, n_valid = _decode_split_bounds(ctx, sliding_window, 0, num_splits, HAS_WINDOW, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    merge = n_valid > 1
    s_mask = (offs_s < n_valid) & merge
    d_mask = offs_d < head_dim

    stat_offs = (seq * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + stat_offs, mask=s_mask, other=_NEG_BIG)
    l_part = tl.load(part_l_ptr + stat_offs, mask=s_mask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0)) * l_part  # [BLOCK_S]; unread partitions weigh 0
    o = tl.load(
        part_out_ptr
        + seq * stride_p_seq
        + head * stride_p_head
        + offs_s[:, None] * stride_p_split
        + offs_d[None, :] * stride_p_dim,
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask & merge,
    )


@triton.jit
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]  # Triton kernel (see above)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    softcap,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_o_tok,
    stride_o_head,
    stride_o_dim,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    stride_bt_seq,
    num_queries_per_kv,
    head_dim,
    block_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    # One program per (query tile, sequence, query head).
    m_blk = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len  # tokens already cached before this chunk

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = prefix + offs_m  # [BLOCK_M] absolute positions

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :] * stride_q_dim,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # Tiles past the end of this sequence's queries get an empty key range.
    hi = tl.minimum(ctx, prefix + (m_blk + 1) * BLOCK_M) * (m_blk * BLOCK_M < q_len).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m_blk * BLOCK_M - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = seq * stride_bt_seq
    kv_head_off = (head // num_queries_per_kv).to(tl.int64) * stride_c_head
    qk_scale = scale * _LOG2E

    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + offs_n
        n_mask = k_pos < hi
        row_offs = _gather_kv_offsets(
            block_tables_ptr, bt_row, k_pos, n_mask, block_size, stride_c_blk, stride_c_off, kv_head_off
        )
        k = tl.load(
            k_cache_ptr + row_offs[None, :] + offs_d[:, None] * stride_c_dim,
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if HAS_SOFTCAP:
            s = _softcap(s * scale, softcap) * _LOG2E
        else:
            s = s * qk_scale
        valid = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            valid = valid & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        s = tl.where(valid, s, float("-inf"))  # [BLOCK_M, BLOCK_N], log2 units

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_cache_ptr + row_offs[:, None] + offs_d[None, :] * stride_c_dim,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :] * stride_o_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

_MAX_DECODE_SPLITS = 16
_MIN_PARTITION = 256


def _check_runnable(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels got CPU tensors; use the torch reference backend on CPU, "
            "or set TRITON_INTERPRET=1 before importing triton"
        )


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")


def _check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> int:
    """Validates shared arguments and returns num_queries_per_kv."""
    _check_cache(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be 3-D [tokens_or_seqs, num_heads, head_dim], got {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: query has {head_dim}, cache has {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from cache dtype {k_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype.is_floating_point:
        raise ValueError("block_tables must be an integer [num_seqs, max_blocks_per_seq] tensor")
    if context_lens.dim() != 1 or context_lens.shape[0] != block_tables.shape[0]:
        raise ValueError("context_lens must be [num_seqs], matching block_tables")
    if context_lens.dtype.is_floating_point:
        raise ValueError("context_lens must be an integer tensor")
    return num_heads // num_kv_heads


def _window_and_softcap(sliding_window: int | None, softcap: float | None) -> tuple[int, float]:
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return (sliding_window or 0), float(softcap or 0.0)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Tile sizes were chosen from sm_90 register usage reported by ptxas (no spills for 16-bit
# dtypes). float32 runs the exact ("ieee") dot, which needs far more registers per tile.
def _decode_config(block_d: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for the decode kernel."""
    if dtype == torch.float32:
        return 32, 4
    return (64, 8) if block_d <= 128 else (32, 8)


def _prefill_config(block_d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the prefill kernel."""
    if dtype == torch.float32:
        return 32, 32, 4
    if block_d <= 64:
        return 64, 64, 4
    return (64, 64, 8) if block_d <= 128 else (64, 32, 8)


def _decode_num_splits(query: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """Splits the context across programs when seqs x kv heads alone cannot fill the GPU."""
    if query.device.type != "cuda":
        return 1
    programs = query.shape[0] * num_kv_heads
    device_index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    target = 2 * _num_sms(device_index)
    if programs >= target:
        return 1
    by_length = triton.cdiv(max_context, _MIN_PARTITION)
    return max(1, min(_MAX_DECODE_SPLITS, by_length, triton.cdiv(target, programs)))


def _split_buffers(
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    num_seqs: int,
    num_heads: int,
    num_splits: int,
    head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 flash-decoding partials: the caller's, checked, or new (uninitialised: the
    kernels read only what they wrote)."""
    stat_shape = (num_seqs, num_heads, num_splits)
    if partials is None:
        part_out = torch.empty(*stat_shape, head_dim, dtype=torch.float32, device=device)
        part_m = torch.empty(stat_shape, dtype=torch.float32, device=device)
        return part_out, part_m, torch.empty_like(part_m)
    for name, t, shape in zip(("out", "max", "sum"), partials, ((*stat_shape, head_dim), stat_shape, stat_shape)):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"partials {name} must be a contiguous float32 {shape} tensor on {device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    return partials


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged cache.

    ``slot_mapping`` is ``[num_tokens]`` (int64); a slot of -1 skips that token. In place.
    """
    _check_cache(k_cache, v_cache)
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if (num_kv_heads, head_dim) != tuple(k_cache.shape[2:]):
        raise ValueError(f"key heads/dim {(num_kv_heads, head_dim)} do not match cache {tuple(k_cache.shape[2:])}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtype must match cache dtype {k_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens]={num_tokens}, got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _check_runnable(key)
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One new query token per sequence against its cached context.

    ``query`` is ``[num_seqs, num_heads, head_dim]``; sequence ``i`` has ``context_lens[i]``
    tokens in the cache, the last of which is the query token itself. Returns
    ``[num_seqs, num_heads, head_dim]`` in the query's dtype; a sequence with context 0 gets
    zeros. ``num_splits`` forces the number of context partitions (flash-decoding); by default
    it is chosen from the shapes alone, so the call never synchronises with the device and a
    captured graph stays valid for any context lengths. Each sequence's span is cut into
    ``num_splits`` equal whole-tile partitions inside the kernel, from its own context length;
    partitions past the span do no work and write nothing.

    ``partials`` optionally supplies the float32 split buffers (``out`` ``[num_seqs, num_heads,
    num_splits, head_dim]``, then max and sum ``[num_seqs, num_heads, num_splits]``, contiguous)
    instead of allocating them per call; only partitions that hold keys of a sequence whose
    span needs more than one partition are written.
    """
    num_queries_per_kv = _check_attention_args(query, k_cache, v_cache, block_tables, context_lens)
    num_seqs, num_heads, head_dim = query.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    window, cap = _window_and_softcap(sliding_window, softcap)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _check_runnable(query)

    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_g = max(16, triton.next_power_of_2(num_queries_per_kv))  # tl.dot needs M >= 16
    block_d = triton.next_power_of_2(head_dim)
    block_n, num_warps = _decode_config(block_d, query.dtype)
    max_context = block_tables.shape[1] * block_size  # upper bound, known without a sync
    if num_splits is None:
        num_splits = _decode_num_splits(query, num_kv_heads, max_context)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    use_split = num_splits > 1

    if use_split:
        part_out, part_m, part_l = _split_buffers(partials, num_seqs, num_heads, num_splits, head_dim, query.device)
        part_strides = part_out.stride()
    else:
        part_out = part_m = part_l = out  # unused by the kernel
        part_strides = (0, 0, 0, 0)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_m,
        part_l,
        float(scale),
        cap,
        window,
        *query.stride(),
        *out.stride(),
        *part_strides,
        *k_cache.stride(),
        block_tables.stride(0),
        num_queries_per_kv,
        num_heads,
        num_splits,
        head_dim,
        block_size,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        USE_SPLIT=use_split,
        IEEE=query.dtype == torch.float32,
        num_warps=num_warps,
    )
    if use_split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_m,
            part_l,
            context_lens,
            out,
            window,
            *part_out.stride(),
            *out.stride(),
            num_heads,
            num_splits,
            head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            BLOCK_N=block_n,  # the decode kernel's: both derive the partitions from it
            HAS_WINDOW=sliding_window is not None,
            num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal varlen prefill over a paged cache that may hold a cached prefix.

    ``query`` is ``[num_tokens, num_heads, head_dim]`` packed by ``cu_seqlens_q``
    (``[num_seqs + 1]``). Sequence ``i``'s queries are the last ``cu[i+1] - cu[i]`` of its
    ``context_lens[i]`` tokens, all of whose K/V are already stored. Returns
    ``[num_tokens, num_heads, head_dim]`` in the query's dtype. Pass ``max_seqlen_q`` to avoid
    a device sync.
    """
    num_queries_per_kv = _check_attention_args(query, k_cache, v_cache, block_tables, context_lens)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens_q must be an integer [num_seqs + 1]={num_seqs + 1} tensor")
    window, cap = _window_and_softcap(sliding_window, softcap)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _check_runnable(query)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out

    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, num_warps = _prefill_config(block_d, query.dtype)
    block_m = min(block_m, max(16, triton.next_power_of_2(max_seqlen_q)))
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        float(scale),
        cap,
        window,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        num_queries_per_kv,
        head_dim,
        k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE=query.dtype == torch.float32,
        num_warps=num_warps,
    )
    return out


# --------------------------------------------------------------------------------------------
# Dense torch references (per sequence, float32)
# --------------------------------------------------------------------------------------------


def _ref_gather(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """Cache rows for positions ``0..context_len-1``: ``[context_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def _ref_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q ``[n_q, num_heads, d]``, k/v ``[n_k, num_kv_heads, d]``; returns float32 ``[n_q, num_heads, d]``."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_heads, n_q, n_k]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def ref_paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense per-sequence reference for :func:`paged_decode_attention`."""
    out = torch.zeros_like(query)
    for i, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:
            continue
        k = _ref_gather(k_cache, block_tables[i], ctx)
        v = _ref_gather(v_cache, block_tables[i], ctx)
        q_pos = torch.tensor([ctx - 1], device=query.device)
        out[i] = _ref_attend(query[i : i + 1], k, v, q_pos, scale, sliding_window, softcap)[0].to(query.dtype)
    return out


def ref_paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense per-sequence reference for :func:`paged_prefill_attention`."""
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        k = _ref_gather(k_cache, block_tables[i], ctx)
        v = _ref_gather(v_cache, block_tables[i], ctx)
        q_pos = torch.arange(ctx - (end - start), ctx, device=query.device)
        out[start:end] = _ref_attend(query[start:end], k, v, q_pos, scale, sliding_window, softcap).to(query.dtype)
    return out
