"""Per-step attention metadata, handed from the model runner to the attention function.

The transformers model modules call our registered attention function once per layer; the step's
metadata travels beside them in a thread-local, so a watchdog-abandoned step on another thread
can never read a newer step's tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    q_start: int  # offset of its first query token in the packed batch
    q_len: int
    context_len: int  # tokens of context including the new ones
    block_table: torch.Tensor | None  # [num_blocks] long; None when nothing was cached before (q_len == context_len)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decode_tokens: int  # decode sequences come first in the packed batch, one token each
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [num_decode] long
    prefills: list[PrefillSeq] = field(default_factory=list)
    # for the Triton backend: packed varlen description of the prefill part
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_prefills] int32
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32
    prefill_max_q: int = 0
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    backend: str = "torch"  # "torch" | "triton"
    masks: dict = field(default_factory=dict)  # per-step masks cached across layers, keyed by shape/window


_local = threading.local()


def set_metadata(md: AttentionMetadata | None) -> None:
    _local.md = md


def get_metadata() -> AttentionMetadata:
    md = getattr(_local, "md", None)
    if md is None:
        raise RuntimeError("batchery attention called outside an engine step (no metadata set)")
    return md
