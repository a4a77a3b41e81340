"""Prefill attention for the CPU over the paged KV pool (a part of ``batchery.engine.cpu_kernels``' extension).

torch's SDPA runs the CPU's prefill attention at a fraction of what its matmuls reach (its flash kernel
re-reads and converts K/V per query block, one query head at a time, and the cached-prefix path first
gathers the whole context into a copy). This kernel does all of a step's prefill chunks in one call per
layer: it reads K/V straight from the block pool through each chunk's block table, packs each context
once into the layouts its register tiles read, serves all query heads of a KV head from one K/V tile
(GQA), and keeps fp32 running max / sum / accumulators (flash-style online softmax). bf16 uses
AVX512-BF16 dot products where the CPU has them, fp32 conversion otherwise; on CPUs with AMX-BF16 its two
products (Q K^T and P V) run on tiles read straight from the same packed K/V, 16 query rows a block
(``attend`` with its AMX flag: 2.6-4x the ``vdpbf16ps`` pass per layer on the 2-core AMX Xeon, 0.8 against 2.2 ms for a
1024-token step of four 200-300-token prompts, 2.5 against 10.2 ms for three 340-token chunks of 700-token
contexts).

``SOURCES`` are its C++ files in ``engine/csrc/``, compiled into that one extension; ``FUNCTIONS`` are the
names it exports. Anything the kernel does not cover (softcap, head_dim not a multiple of 32, other dtypes, a
build without AVX-512) stays on the torch path in ``torch_backend``."""

from __future__ import annotations

import torch

from batchery.engine import cpu_kernels
from batchery.engine.attention.metadata import AttentionMetadata

SOURCES: tuple[str, ...] = ("prefill_attention.cpp",)
FUNCTIONS: list[str] = ["prefill_attention", "has_prefill_attention", "prefill_set_amx", "prefill_amx"]

_STEP_KEY = "cpu_prefill"  # the per-step chunk description, kept in ``AttentionMetadata.masks`` for all layers
_available: bool | None = None


def available() -> bool:
    """Whether the built extension has the kernel (it needs AVX-512; elsewhere torch keeps prefill)."""
    global _available
    if _available is None:
        kernels = cpu_kernels.load()
        _available = kernels is not None and bool(kernels.has_prefill_attention())
    return _available


def supports(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether the kernel runs this layer's prefill: fp32 / bf16 on the CPU, head_dim a multiple of 32, no softcap."""
    return (
        not softcap
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.shape[-1] % 32 == 0
        and available()
    )


def _step_arrays(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prefill chunks as the kernel reads them, built once per step (every layer shares them):
    seqs int64 [S, 4] of (q_start, q_len, context_len, row of ``tables`` or -1 when nothing was cached:
    the keys are then the chunk's own k/v), and tables int64 [rows, max_blocks]."""
    cached = md.masks.get(_STEP_KEY)
    if cached is None:
        rows: list[list[int]] = []
        blocks: list[torch.Tensor] = []
        for p in md.prefills:
            rows.append([p.q_start, p.q_len, p.context_len, -1 if p.block_table is None else len(blocks)])
            if p.block_table is not None:
                blocks.append(p.block_table)
        width = max((len(b) for b in blocks), default=1)
        tables = torch.zeros(len(blocks), width, dtype=torch.long)
        for i, b in enumerate(blocks):
            tables[i, : len(b)] = b
        cached = md.masks[_STEP_KEY] = (torch.tensor(rows, dtype=torch.long).view(-1, 4), tables)
    return cached


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Writes every prefill chunk's attention into its rows of ``out``. q, out: [T, H, D]; k, v: [T, Hkv, D]
    (any strides with the last dimension contiguous; already stored in the caches); caches
    [num_blocks, block_size, Hkv, D]. Query i of a chunk sits at position context_len - q_len + i and attends
    keys up to it (within ``sliding_window`` of it when set). Only for what ``supports`` accepts."""
    kernels = cpu_kernels.load()
    assert kernels is not None  # supports() said so
    seqs, tables = _step_arrays(md)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    kernels.prefill_attention(
        q, k, v, k_cache, v_cache, out, seqs, tables, float(scale), int(sliding_window or 0), True
    )


def segments_array(bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``segment_attention``'s ``seqs`` for inputs packed at (first row, rows): built once per step."""
    return torch.tensor([[start, n, n, -1] for start, n in bounds], dtype=torch.long).view(-1, 4)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, seqs: torch.Tensor, scale: float, causal: bool
) -> None:
    """Attention within each packed segment, nothing cached (a pooling model's step): ``out`` rows of segment s
    attend its own keys only, all of them (``causal=False``: encoders) or up to their own position. q, out:
    [T, H, D]; k, v: [T, Hkv, D]; any strides with the last dimension contiguous; ``seqs`` from
    ``segments_array``. A row's sums never depend on the other segments. Only for what ``supports`` accepts."""
    kernels = cpu_kernels.load()
    assert kernels is not None  # supports() said so
    hkv, d = k.shape[1], k.shape[2]
    none = q.new_empty(0, 1, hkv, d)  # no pool: every segment's keys are its own k/v rows
    tables = torch.zeros(0, 1, dtype=torch.long)
    kernels.prefill_attention(q, k, v, none, none, out, seqs, tables, float(scale), 0, causal)
