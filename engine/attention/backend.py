"""The attention function registered with transformers' attention-function registry.

Each attention layer of a transformers model calls it with the packed step's query/key/value.
It writes K/V into the paged pool through the slot mapping, then attends over the block tables,
honouring what the model passes: ``scaling``, ``sliding_window`` and ``softcap``."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from batchery.engine.attention import cpu_paged, torch_backend
from batchery.engine.attention.metadata import get_metadata

ATTN_IMPLEMENTATION = "batchery_paged"


class _AttentionModule(Protocol):
    """What we read of the attention module transformers passes in."""

    layer_idx: int  # set on every attention module by transformers: which layer's KV pair to use


def paged_attention_forward(
    module: _AttentionModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``attention_mask`` and ``dropout`` are unused
    (the block tables say what each query sees; inference has no dropout). Returns the
    [1, T, H, D] output and no attention weights."""
    md = get_metadata()
    # query: [1, H, T, D]; key/value: [1, Hkv, T, D] -> token-major [T, heads, D]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    if md.backend == "triton":
        from batchery.engine.attention import triton_backend

        out = triton_backend.paged_attention(q, k, v, k_cache, v_cache, md, scale, sliding_window, softcap)
    else:  # "torch" reference, or "cpu" (the reference with the C++ store and decode/prefill kernels)
        if md.backend != "cpu" or not cpu_paged.store_kv(k, v, k_cache, v_cache, md.slot_mapping):
            torch_backend.store_kvcache(k, v, k_cache, v_cache, md.slot_mapping)
        out = torch_backend.paged_attention(q, k, v, k_cache, v_cache, md, scale, sliding_window, softcap)
    return out.unsqueeze(0), None  # [1, T, H, D]


def register() -> None:
    """Idempotent: make ``attn_implementation=ATTN_IMPLEMENTATION`` known to transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
