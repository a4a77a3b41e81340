"""Decode steps replayed from CUDA graphs.

A decode-only step is a few hundred small kernel launches (per layer: norms, projections, rotary,
KV store, paged decode, MLP). At the batch sizes of steady decoding the GPU runs them faster than
Python can issue them, so the runner captures the whole model forward once per batch-size bucket
at start-up and replays it afterwards:

- the graphs read static input buffers (token ids, positions, slot mapping, block tables and
  context lengths) sized for the largest bucket;
- a decode step with ``n`` sequences copies its inputs into the first ``n`` rows and pads the
  rest of its bucket with rows that store nothing (slot -1) and attend to nothing (context 0);
- it replays the bucket's graph and samples from the first ``n`` rows of the logits.

Every graph writes its logits into the first rows of one shared output buffer sized for the
largest bucket (nano-vllm's ``outputs[:bs] = model(...)``). A graph's output is memory the graph
owns for as long as it lives, so one logits tensor per graph would keep the sum of all bucket
sizes x vocab alive (0.83 GB for a 49k vocabulary at 512 sequences, 2.2 GB at 128k); with the
copy into the shared buffer, each capture's own logits is a temporary of the graphs' common
pool, freed before the next (smaller) capture reuses that memory. The alternative, graphs that
stop at the hidden states with the LM head run eagerly on the real rows, would also skip the
padding rows' LM head, but it splits every model's forward in two and would skip whatever a
model does after its LM head (logit soft-capping, logit scaling); the copy keeps the model's own
forward whole, at the cost of one [bs, vocab] copy inside the graph.

Prefill and mixed steps, and decode batches above the largest bucket, run eagerly. Capture runs
only on CUDA with the Triton attention backend; where CUDA graphs are missing or capture fails,
the runner logs why and runs every step eagerly. ``capture=False`` runs the same static-buffer
path without graphs, which is how the CPU tests check the padding and buffer logic."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from batchery.engine.attention.metadata import AttentionMetadata
from batchery.engine.packed_step import PackedStep

log = logging.getLogger("batchery.engine.graphs")

# The model on a decode batch: (input_ids [1, bs], positions [1, bs], metadata) -> logits [bs, vocab].
# Captured into the graphs, so it must not depend on anything but its arguments and the model.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted(set(sizes) | {max_num_seqs})


def logits_bytes(sizes: list[int], vocab: int, elem_size: int, shared: bool = True) -> int:
    """Bytes of logits the captured graphs keep alive: one buffer for the largest bucket when
    ``shared``, else (one output per graph, as before) the sum over the buckets. A pure function,
    so the saving can be checked where no graph can be captured."""
    rows = max(sizes) if shared else sum(sizes)
    return rows * vocab * elem_size


class DecodeGraphs:
    """Static input buffers for decode batches of up to ``max_num_seqs`` sequences, and (with
    ``capture``) one CUDA graph of ``forward`` per batch-size bucket. ``kv_caches`` and ``backend``
    go into the attention metadata of every run; ``max_blocks_per_seq`` is the block-table width
    of a sequence at the longest context."""

    def __init__(
        self,
        forward: DecodeForward,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: str,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        capture: bool = True,
    ) -> None:
        self.model_forward = forward
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = device
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        n, dev = self.max_size, device
        # the graphs' inputs: token ids, positions and slots are the rows of one [3, n] tensor, so
        # that one copy moves all three
        self.long_inputs = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.long_inputs[2].fill_(-1)
        self.input_ids = self.long_inputs[0:1]  # [1, n]
        self.positions = self.long_inputs[1:2]  # [1, n]
        self.slots = self.long_inputs[2]  # [n]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)  # [n, width]
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)  # [n]
        # Persistent host copies of those buffers, filled in place through numpy each step and sent
        # with non-blocking copies. Pinned on CUDA: a copy from pageable memory is staged through a
        # driver buffer and blocks the host until it is done, five times a step; from pinned memory
        # it is one DMA the host does not wait for. ``staged`` marks the copies' completion on the
        # stream, so the host never rewrites a buffer a copy may still be reading.
        pin = dev.type == "cuda"
        self.host_long = torch.zeros(3, n, dtype=torch.long, pin_memory=pin)
        self.host_long[2].fill_(-1)
        self.host_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.host_lens = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self.staged: torch.cuda.Event | None = torch.cuda.Event() if pin else None
        # [n, vocab] every bucket's logits land in (the first bs rows); allocated by the first
        # forward, which gives the LM head's real width and dtype
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0  # decode steps run through the static buffers
        if capture:
            self._capture_all()

    def _forward_bucket(self, bs: int) -> torch.Tensor:
        """The model on the first ``bs`` rows of the static buffers, its logits copied into the
        first ``bs`` rows of the shared output buffer; returns that [bs, vocab] view."""
        md = AttentionMetadata(
            slot_mapping=self.slots[:bs],
            num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs],
            decode_context_lens=self.context_lens[:bs],
            kv_caches=self.kv_caches,
            backend=self.backend,
        )
        logits = self.model_forward(self.input_ids[:, :bs], self.positions[:, :bs], md)
        if self.logits is None:
            self.logits = torch.empty(self.max_size, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        out = self.logits[:bs]
        out.copy_(logits)
        return out

    def _capture_all(self) -> None:
        """One graph per bucket, largest first, all in one memory pool (a smaller bucket's
        activations reuse a larger one's). The buffers hold padding rows only, so the warm-up and
        captured runs store no K/V and read none."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._forward_bucket(bs)  # warm-up: compiles the Triton kernels for this shape outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward_bucket(bs)  # the model's own logits: a pool temporary, freed here
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
            len(self.graphs),
            self.sizes[0],
            self.max_size,
            time.perf_counter() - t0,
        )

    def run(self, p: PackedStep, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode-only step of ``n <= max_size`` sequences; returns their [n, vocab] logits, a
        view of the shared buffer that the next step overwrites (sample from it before then).
        ``prev_tokens`` (async scheduling): the previous step's sampled ids on the device, which
        the placeholder ids (``-1 - j``) among the inputs are replaced with before the replay."""
        n = p.num_tokens
        bs = next(s for s in self.sizes if s >= n)
        self.stage(p, bs)
        if prev_tokens is not None:
            ids = self.input_ids[:, :n]
            ids.copy_(torch.where(ids < 0, prev_tokens[(-1 - ids).clamp_min(0)], ids))
        self.num_runs += 1
        graph = self.graphs.get(bs)
        if graph is not None and self.logits is not None:
            graph.replay()
            return self.logits[:n]
        return self._forward_bucket(bs)[:n]

    def stage(self, p: PackedStep, bs: int) -> None:
        """The step's inputs into the first ``bs`` rows of the static buffers: written into the
        host buffers, then three non-blocking copies. Rows ``n:bs`` are padding (slot -1, context
        0), since an earlier, larger batch left real slots and lengths there. Block tables are the
        persistent batch's rows (``p.block_tables``), their first ``p.decode_width`` columns."""
        n = p.num_tokens
        if self.staged is not None:
            self.staged.synchronize()  # the previous step's copies have read the host buffers
        hl = self.host_long.numpy()
        hl[0, :n] = p.input_ids
        hl[1, :n] = p.positions
        hl[2, :n] = p.slots
        hl[2, n:bs] = -1
        lens = self.host_lens.numpy()
        lens[:n] = p.decode_lens
        lens[n:bs] = 0
        # only the step's widest table's columns: the rest of each row keeps what an earlier step left,
        # which no kernel reads (each reads a row only up to its context), so a long max_model_len
        # (a wide static buffer) costs nothing here
        w = p.decode_width
        self.host_tables.numpy()[:n, :w] = p.block_tables[p.decode_rows, :w]
        self.long_inputs[:, :bs].copy_(self.host_long[:, :bs], non_blocking=True)
        self.context_lens[:bs].copy_(self.host_lens[:bs], non_blocking=True)
        self.block_tables[:n].copy_(self.host_tables[:n], non_blocking=True)
        if self.staged is not None:
            self.staged.record()
