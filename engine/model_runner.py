"""Owns torch: the model, the paged KV tensors, the attention backend and the sampler.

Each step runs the transformers model modules on one packed row holding every scheduled token
of every sequence, with explicit position ids; our registered attention function writes K/V
through the slot mapping and attends over block tables. Only the rows that sample a token go
through the LM head (``logits_to_keep``). On CUDA with the Triton backend, decode-only steps are
replayed from CUDA graphs captured at start-up (``batchery.engine.cuda_graphs``)."""

from __future__ import annotations

import functools
import gc
import logging
import mmap
import os
from typing import Any

import numpy as np
import torch

from batchery.engine.attention.backend import ATTN_IMPLEMENTATION, register
from batchery.engine.attention.metadata import AttentionMetadata, PrefillSeq, set_metadata
from batchery.engine.config import EngineConfig
from batchery.engine.cuda_graphs import DecodeGraphs
from batchery.engine.loader import LoadedModel
from batchery.engine.outputs import ModelRunnerOutput
from batchery.engine.packed_step import PackedPrefill, PackedStep, pack_arrays, packed_nbytes, unpack_segments
from batchery.engine.persistent_batch import PersistentBatch
from batchery.engine.sampler import SampledStep, Sampler
from batchery.engine.sequence import Sequence

log = logging.getLogger("batchery.engine.runner")

CPU_KV_FRACTION = 0.4  # of the memory available after the weights are loaded (MemAvailable, or the cgroup's limit)
MIN_CPU_KV_BYTES = 64 << 20  # what a CPU pool gets at least, however little memory looks available
GPU_KV_FRACTION = 0.85  # of the memory free after the weights are loaded
MAX_DEFAULT_MODEL_LEN = 8192


def _text_config(hf_config: Any) -> Any:
    """The decoder's config (a multimodal model nests it); transformers configs are untyped attribute bags."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


@torch.inference_mode()
def run_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    md: AttentionMetadata,
    logits_to_keep: torch.Tensor | int = 0,
) -> torch.Tensor:
    """The model on one packed row: input_ids, positions [1, num_tokens]; returns [num_keep, vocab]
    logits (``logits_to_keep`` 0: every row). A plain function of the model, so the decode graphs
    can hold it without holding the runner."""
    set_metadata(md)
    try:
        out = model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=logits_to_keep)
    finally:
        set_metadata(None)
    return out.logits[0]  # [num_keep, vocab]


def _slots_into(out: np.ndarray, blocks: np.ndarray, positions: np.ndarray, block_size: int) -> None:
    """The KV slots of ``positions`` into ``out``: ``blocks`` (the block holding each position)
    times the block size, plus the offset in the block; in int64 whatever the tables' dtype."""
    out[:] = blocks
    out *= block_size
    out += positions % block_size


def cpu_available_memory() -> int:
    """Bytes this process could still take: ``MemAvailable``, or less where a cgroup (a container's memory limit)
    allows less. Read after the weights are loaded, so they are not counted twice."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:  # not Linux: what the OS reports as physical memory
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # cgroup v2
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read())
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over a private anonymous mapping: zero-filled by the kernel, committed page by page when
    written, unmapped when the tensor (which holds the mapping) is freed."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        register()
        self.config = config
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cfg = _text_config(loaded.hf_config)
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size

        model_len = config.max_model_len or min(
            getattr(cfg, "max_position_embeddings", MAX_DEFAULT_MODEL_LEN), MAX_DEFAULT_MODEL_LEN
        )
        self.num_kv_blocks = self._num_blocks(model_len)
        self.max_model_len = min(model_len, self.num_kv_blocks * self.block_size)
        shape = (self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(self._zeroed(shape), self._zeroed(shape)) for _ in range(self.num_layers)]
        self.backend = self._pick_backend()
        # every sequence's block table as a row kept from step to step (int32 as the Triton kernels read them)
        self.batch = PersistentBatch(
            config.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            np.int32 if self.backend == "triton" else np.int64,
        )
        self.sampler = Sampler(self.device, config.seed)
        self.graphs = self._capture_graphs()

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Decode CUDA graphs (``batchery.engine.cuda_graphs``) on CUDA with the Triton backend; None elsewhere,
        when turned off, or when capture fails (then every step runs eagerly)."""
        if not self.config.cuda_graphs or self.device.type != "cuda" or self.backend != "triton":
            return None
        try:
            return self.build_decode_graphs()
        except Exception as e:  # the engine must still run where graphs cannot be captured
            log.warning("CUDA graphs disabled, every step runs eagerly: %s: %s", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return None

    def build_decode_graphs(self, capture: bool = True) -> DecodeGraphs:
        """Decode graphs over this runner's model and KV cache; ``capture=False`` keeps only their
        static buffers (how the CPU tests run that path). They hold the model, not the runner."""
        return DecodeGraphs(
            functools.partial(run_model, self.model),
            self.kv_caches,
            self.backend,
            self.device,
            self.config.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            capture=capture,
        )

    def kv_cache_bytes(self) -> int:
        """Bytes of this runner's KV pool: what a replacement engine of the same capacity needs
        (the supervisor weighs it against the free memory after a hang)."""
        return self.num_kv_blocks * self._bytes_per_block()

    def _bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_blocks(self, model_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            # An engine dropped just before (a rebuild, a test) may still be held by a reference
            # cycle somewhere, and the caching allocator keeps what was freed: let both go, or the
            # old KV pool counts as used and this one is sized from what is left beside it.
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_KV_FRACTION)
        else:
            budget = max(int(cpu_available_memory() * CPU_KV_FRACTION), MIN_CPU_KV_BYTES)
        blocks = budget // self._bytes_per_block()
        # never more than every slot filled to the full context needs
        blocks = min(blocks, c.max_num_seqs * (-(-model_len // self.block_size)))
        if blocks < 1:
            raise ValueError(f"the KV-cache budget of {budget} bytes does not hold a single block")
        return int(blocks)

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-filled KV tensor. On the CPU it lives in anonymous memory that the kernel maps to zero pages
        and commits only when a block is first written: a pool sized from the machine's memory costs nothing
        at start-up (``torch.zeros`` writes every page: 2.7 s per GiB on a 2-core VM) and only the blocks in
        use take memory. Zero matters: attention may multiply unused slots by zero weights, and 0 * NaN is NaN."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return anonymous_zeros(shape, self.dtype)

    def _pick_backend(self) -> str:
        want = self.config.attention_backend
        if want == "torch":
            return "torch"
        if want in ("auto", "cpu") and self.device.type == "cpu":
            from batchery.engine.attention import cpu_paged

            if cpu_paged.supports_dtype(self.dtype) and cpu_paged.load() is not None:
                return "cpu"
            if want == "cpu":
                raise RuntimeError("attention_backend='cpu' but the CPU kernel could not be built (see the log)")
            return "torch"
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("attention_backend='triton' on the CPU needs TRITON_INTERPRET=1 (set before start)")
        try:
            import triton  # noqa: F401

            from batchery.engine.attention import triton_backend  # noqa: F401
        except Exception as e:  # the engine must still run where Triton is missing
            if want == "triton":
                raise RuntimeError(f"attention_backend='triton' but Triton is unavailable: {e}") from e
            log.warning("Triton unavailable (%s); using the torch attention backend", e)
            return "torch"
        return "triton"

    def pack(self, seqs: list[Sequence], num_new_tokens: list[int]) -> PackedStep:
        """The step on the host: decode sequences first, then prefill chunks, each sequence's
        block table a row of the persistent batch (synced here: only rows that changed are
        written). A decode sequence costs a few reads and list appends, and the step's decode
        inputs become arrays in one conversion: at hundreds of sequences a step, every numpy call
        saved counts (each costs microseconds with the caches cold after the forward)."""
        bs = self.block_size
        batch = self.batch
        batch.begin_step()
        step = batch.step
        row_of, synced_list, synced_len, last_step = batch.row_of, batch.synced_list, batch.synced_len, batch.last_step
        dec_ids: list[int] = []
        dec_pos: list[int] = []
        dec_slots: list[int] = []
        dec_rows: list[int] = []
        keep: list[int] = []
        sample_seqs: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []
        width = 1
        for seq, n in zip(seqs, num_new_tokens):  # noqa: B905 (the scheduler's two lists; strict costs a check a step)
            start = seq.num_computed_tokens
            if n == 1 and start > 0:
                token_ids = seq.token_ids
                if start + 1 == len(token_ids):  # the whole sequence is computed: sample its next token
                    keep.append(len(dec_rows))
                    sample_seqs.append(seq)
                table = seq.block_table
                num_blocks = len(table)
                r = row_of.get(seq)
                if r is None or synced_list[r] is not table or synced_len[r] != num_blocks:
                    r = batch.sync(seq)
                else:  # PersistentBatch.row's fast path, inlined
                    last_step[r] = step
                if num_blocks > width:
                    width = num_blocks
                dec_ids.append(token_ids[start])
                dec_pos.append(start)
                dec_slots.append(table[start // bs] * bs + start % bs)
                dec_rows.append(r)
            else:
                chunks.append((seq, n))
        nd = len(dec_rows)
        if not chunks:
            # [4, nd] ids, positions, slots and rows, then the rows to sample
            flat = np.array(dec_ids + dec_pos + dec_slots + dec_rows + keep, dtype=np.int64)
            positions = flat[nd : 2 * nd]
            return PackedStep(
                input_ids=flat[:nd],
                positions=positions,
                slots=flat[2 * nd : 3 * nd],
                logits_idx=flat[4 * nd :],
                sample_seqs=sample_seqs,
                block_tables=batch.tables,
                decode_rows=flat[3 * nd : 4 * nd],
                decode_lens=positions + 1,
                decode_width=width,
            )
        return self._pack_with_chunks(batch, chunks, dec_ids, dec_pos, dec_slots, dec_rows, keep, sample_seqs, width)

    def _pack_with_chunks(
        self,
        batch: PersistentBatch,
        chunks: list[tuple[Sequence, int]],
        dec_ids: list[int],
        dec_pos: list[int],
        dec_slots: list[int],
        dec_rows: list[int],
        keep: list[int],
        sample_seqs: list[Sequence],
        width: int,
    ) -> PackedStep:
        """``pack`` for a step with prefill chunks: their tokens after the decode ones, the
        per-token arrays by numpy operations (a chunk can be thousands of tokens)."""
        bs = self.block_size
        nd = len(dec_rows)
        num_tokens = nd + sum(n for _, n in chunks)
        tables = batch.tables
        ids = np.empty(num_tokens, dtype=np.int64)  # [num_tokens]
        pos = np.empty(num_tokens, dtype=np.int64)  # [num_tokens]
        slots = np.empty(num_tokens, dtype=np.int64)  # [num_tokens]
        ids[:nd] = dec_ids
        pos[:nd] = dec_pos
        slots[:nd] = dec_slots
        p = PackedStep(input_ids=ids, positions=pos, slots=slots, sample_seqs=sample_seqs, block_tables=tables)
        if nd:
            p.decode_rows = np.array(dec_rows, dtype=np.int64)
            p.decode_lens = pos[:nd] + 1
            p.decode_width = width
        prefill_rows = []
        q = nd
        for seq, n in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            r = batch.row(seq)
            ids[q : q + n] = seq.token_ids[start:end]
            cpos = pos[q : q + n]
            cpos[:] = np.arange(start, end)
            _slots_into(slots[q : q + n], tables[r, cpos // bs], cpos, bs)
            p.prefills.append(PackedPrefill(q, n, end, seq.block_table))
            prefill_rows.append(r)
            if end == seq.num_tokens:  # the whole sequence is computed: sample its next token
                keep.append(q + n - 1)
                sample_seqs.append(seq)
            q += n
        p.prefill_rows = np.array(prefill_rows, dtype=np.int64)
        p.prefill_width = max(int(batch.num_blocks[p.prefill_rows].max()), 1)
        p.logits_idx = np.array(keep, dtype=np.int64)
        return p

    def prepare(
        self, p: PackedStep
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[Sequence]]:
        """The packed step as device tensors: input ids and positions [1, num_tokens], the rows to
        sample [num_sample], the attention metadata, and the sequences those rows sample for. All of
        it in one host-to-device copy (on the CPU, the host arrays themselves)."""
        bs = self.block_size
        triton = self.backend == "triton"
        nd, num_prefills = p.num_decode, len(p.prefills)
        # ids and positions shaped [1, num_tokens] here: a numpy reshape costs less than indexing the tensor
        host = [p.slots, p.input_ids.reshape(1, -1), p.positions.reshape(1, -1), p.logits_idx]
        if nd:
            host += [p.decode_lens.astype(np.int32) if triton else p.decode_lens, p.decode_tables()]
        max_q = 0
        if num_prefills:
            host.append(p.prefill_tables())
            if triton:
                from batchery.engine.attention import triton_backend

                cu, ctx, max_q = triton_backend.prefill_arrays(p.prefills)
                host += [cu, ctx]
        dev = self._to_device(host)
        slots, ids, pos, keep = dev[:4]
        md = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            decode_block_tables=dev[5] if nd else None,
            decode_context_lens=dev[4] if nd else None,
            kv_caches=self.kv_caches,
            backend=self.backend,
        )
        if num_prefills:
            i = 6 if nd else 4
            if triton:
                md.prefill_block_tables, md.prefill_cu_seqlens_q, md.prefill_context_lens = dev[i : i + 3]
                md.prefill_max_q = max_q
            else:
                tables = dev[i]
                for j, pf in enumerate(p.prefills):
                    # [num_blocks] of its context; None: it attends only to its own new tokens
                    bt = tables[j, : -(-pf.context_len // bs)] if pf.has_prefix else None
                    md.prefills.append(PrefillSeq(pf.q_start, pf.q_len, pf.context_len, bt))
        return ids, pos, keep, md, p.sample_seqs

    def _to_device(self, arrays: list[np.ndarray] | list[list[int]]) -> list[torch.Tensor]:
        """Host arrays (int lists become int64) as device tensors of their dtypes and shapes. On
        CUDA in one copy: packed into one pinned byte buffer (torch's caching host allocator keeps
        the block until the copy has read it), sent with one non-blocking copy (from pageable
        memory every copy blocks the host until it is done), returned as views of the device copy.
        Elsewhere the arrays themselves, as tensors."""
        arrs = [np.asarray(a, dtype=np.int64) if isinstance(a, list) else a for a in arrays]
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrs]
        buf = torch.empty(packed_nbytes(arrs), dtype=torch.uint8, pin_memory=True)
        _, segments = pack_arrays(arrs, buf.numpy())
        return unpack_segments(buf.to(self.device, non_blocking=True), segments)

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor | int, md: AttentionMetadata
    ) -> torch.Tensor:
        """ids, pos [1, num_tokens]; keep: the rows to compute logits for. Returns [num_keep, vocab]."""
        return run_model(self.model, ids, pos, md, keep)

    def run(self, seqs: list[Sequence], num_new_tokens: list[int], eos_ids: list[int]) -> ModelRunnerOutput:
        """One engine step on the device: the scheduled tokens through the model, then a token sampled
        for every sequence that is now fully computed."""
        logits, sample_seqs = self._forward_step(seqs, num_new_tokens, None)
        if logits is None:
            return ModelRunnerOutput()
        tokens, entries = self.sampler(logits, sample_seqs, eos_ids)
        return ModelRunnerOutput(sample_seqs, tokens, entries)

    def launch(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        eos_ids: list[int],
        prev_tokens: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """``run`` queued on the device, its sampled ids not read back yet (``LaunchedStep.get``
        reads them; on CUDA their copy to the host is already under way). ``prev_tokens``: the
        sampled ids of the step launched before, still on the device (async scheduling): an input
        id ``-1 - j`` (a placeholder the scheduler gave a token not yet on the host) is its ``j``-th."""
        logits, sample_seqs = self._forward_step(seqs, num_new_tokens, prev_tokens)
        if logits is None:
            return LaunchedStep([], None)
        return LaunchedStep(sample_seqs, self.sampler.sample(logits, sample_seqs, eos_ids))

    def _forward_step(
        self, seqs: list[Sequence], num_new_tokens: list[int], prev_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[Sequence]]:
        """The step packed and through the model: the logits of the rows that sample and their
        sequences (None: a step of partial prefills, nothing to sample)."""
        p = self.pack(seqs, num_new_tokens)
        if self.graphs is not None and not p.prefills and p.num_decode <= self.graphs.max_size:
            logits = self.graphs.run(p) if prev_tokens is None else self.graphs.run(p, prev_tokens)
            sample_seqs = p.sample_seqs
            if len(sample_seqs) != p.num_decode:  # a 1-token chunk of a longer recompute samples nothing
                logits = logits[self._to_device([p.logits_idx])[0]]
            return logits, sample_seqs
        ids, pos, keep, md, sample_seqs = self.prepare(p)
        if prev_tokens is not None:
            ids = fill_placeholders(ids, prev_tokens)
        if not sample_seqs:
            keep = keep.new_zeros(1)  # a pure partial-prefill step: compute K/V, sample nothing
        logits = self.forward(ids, pos, keep, md)
        return (logits if sample_seqs else None), sample_seqs


def fill_placeholders(ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """``ids`` with each placeholder ``-1 - j`` replaced by ``prev_tokens[j]``, on the device (no
    sync: the ids the previous step sampled never go through the host on their way in)."""
    return torch.where(ids < 0, prev_tokens[(-1 - ids).clamp_min(0)], ids)


class LaunchedStep:
    """A step queued on the device: the sequences it samples for, in row order, and their tokens
    (``SampledStep``; None when it samples nothing). ``tokens`` is the device tensor of the sampled
    ids; ``get()`` waits for them and returns the step's ``ModelRunnerOutput``."""

    def __init__(self, sample_seqs: list[Sequence], sampled: SampledStep | None) -> None:
        self.sample_seqs = sample_seqs
        self.sampled = sampled
        if sampled is not None:
            sampled.copy_to_host()

    @property
    def tokens(self) -> torch.Tensor | None:
        """The sampled ids on the device; None when the step sampled nothing (a graph step of 1-token
        recompute chunks samples from zero rows), so that no placeholder can refer to it."""
        return self.sampled.tokens if self.sampled is not None and self.sample_seqs else None

    @property
    def needs_host(self) -> bool:
        """Some row's next step cannot be built before its token is on the host (``SampledStep``)."""
        return self.sampled is not None and self.sampled.needs_host

    def get(self) -> ModelRunnerOutput:
        if self.sampled is None:
            return ModelRunnerOutput()
        tokens, entries = self.sampled.result()
        return ModelRunnerOutput(self.sample_seqs, tokens, entries)
