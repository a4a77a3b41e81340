"""Paged decode attention for the CPU, as a small C++ kernel built on first use.

The torch reference has to gather every sequence's KV blocks into a padded copy before SDPA can
read them; at decode time that copy is most of the memory traffic of a step. This kernel reads
K and V straight from the block pool, once per step, in parallel over sequences (and KV heads when
there are few sequences); ``store_kv`` writes the step's K/V into the pool, one row per token, in parallel.
It is compiled with the other CPU kernels (``batchery.engine.cpu_kernels``); if
the build fails, the torch reference path is used instead."""

from __future__ import annotations

import types

import torch

from batchery.engine import cpu_kernels


def load() -> types.ModuleType | None:
    """The compiled kernels, or None when they cannot be built here (then the torch path is used)."""
    return cpu_kernels.load()


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] long;
    context_lens [B] long. Returns [B, H, D]."""
    kernels = load()
    assert kernels is not None  # the "cpu" backend is picked only once they loaded
    return kernels.paged_decode(
        q, k_cache, v_cache, block_tables, context_lens, float(scale), int(sliding_window or 0), float(softcap or 0.0)
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """``torch_backend.store_kvcache`` in C++: key/value [T, Hkv, D] into the caches at ``slot_mapping`` (a
    negative slot is skipped). False, with nothing written, when the tensors are not laid out for the kernel
    (the caller stores them through torch)."""
    kernels = load()
    if (
        kernels is None
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous())
        or key.dtype != k_cache.dtype
        or value.dtype != k_cache.dtype
        or slot_mapping.dtype != torch.long
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or key.stride(-2) != key.shape[-1]
        or value.stride(-2) != value.shape[-1]
    ):
        return False
    kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    return True
