"""Runs a pooling model on a packed step: many whole inputs in one row, no KV cache.

The transformers model module runs as it is (``AutoModel``: ``BertModel`` for the encoders, the base
model of a decoder used as an embedder), on one packed row of every scheduled input's tokens with
explicit position ids (each input counts from 0) and token type ids. Our attention function, registered
with transformers' registry, attends within each input's own rows only: bidirectionally for encoders,
causally for decoders. Each input is attended alone, so its rows never depend on what shares the step. On
the CPU every input's attention runs in one call of the prefill kernel (``cpu_prefill.segment_attention``:
q/k/v read in place, every (input, head, query tile) a task across the threads); elsewhere, or where the
kernel does not cover the layer, one torch SDPA call per input.

Linear layers see every row of the step at once. torch's CPU GEMM (MKL) can take another path, and sum in
another order, for one row count than for another: on a 2-core Intel Xeon (AMX) the 1536 -> 384 projection
with 2 threads gave other bits for 1 to 190 rows than for more (on AMD EPYC only below 32 rows). So in fp32
on the CPU every linear runs on blocks of exactly ``ROW_BLOCK`` rows (the step is padded to a multiple of it
with a throwaway segment): one GEMM shape, whatever shares the step, and a row's bits do not depend on its
place in the block, so the same input gives the same bits alone and in a full step. Other dtypes pad to
``MIN_STEP_ROWS`` (bf16 runs our kernels, whose sums never depend on the row count)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchery.engine.attention import cpu_prefill
from batchery.engine.config import EngineConfig
from batchery.engine.loader import _model_path, resolve_device, resolve_dtype
from batchery.engine.pooling import PoolerConfig, pool, read_pooler_config

log = logging.getLogger("batchery.engine.pooling")

ATTN_IMPLEMENTATION = "batchery_packed"
MIN_STEP_ROWS = 32  # GEMMs below this many rows may sum in another order (see the module docstring)
ROW_BLOCK = 256  # fp32 on the CPU: every linear runs on blocks of exactly this many rows

_local = threading.local()  # the step's segments, read by the attention function (thread-local, as metadata.py)


@dataclass
class _Segments:
    bounds: list[tuple[int, int]]  # (first row, rows) of each input in the packed row
    causal: bool  # decoders used as embedders attend causally
    seqs: torch.Tensor | None = None  # the CPU kernel's description of the bounds (cpu_prefill.segments_array)


def packed_attention_forward(
    module: Any,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``attention_mask`` and ``dropout`` are unused (the
    segments say what each query sees; inference has no dropout). Returns [1, T, H, D]."""
    seg: _Segments | None = getattr(_local, "segments", None)
    if seg is None:
        raise RuntimeError("batchery packed attention called outside a pooling step")
    if softcap is not None:
        raise NotImplementedError("the pooling runner does not implement attention logit soft-capping")
    causal = seg.causal and bool(getattr(module, "is_causal", True))
    if seg.seqs is not None and sliding_window is None and cpu_prefill.supports(query, softcap):
        # every segment in one call, q/k/v read in place ([1, heads, T, D] views of [T, heads, D] rows)
        out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        cpu_prefill.segment_attention(q, k, v, out, seg.seqs, scale, causal)
        return out.unsqueeze(0), None
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [1, T, H, D]
    for start, n in seg.bounds:
        if sliding_window is not None and n > sliding_window:
            raise NotImplementedError("the pooling runner does not implement sliding-window attention")
        q, k, v = (t[:, :, start : start + n] for t in (query, key, value))  # [1, heads, n, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=causal, enable_gqa=gqa)
        out[:, start : start + n] = o.transpose(1, 2)
    return out, None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the attention function needs no mask: each segment is attended alone


def register() -> None:
    """Idempotent: make ``attn_implementation=ATTN_IMPLEMENTATION`` known to transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _no_mask)


@dataclass
class LoadedEncoder:
    """A pooling model's weights, tokenizer and pooler, loaded once per process."""

    model: Any  # a transformers base model (AutoModel), in eval mode, on ``device``
    tokenizer: Any
    hf_config: Any
    pooler: PoolerConfig
    dtype: torch.dtype
    device: torch.device
    is_causal: bool  # a decoder used as an embedder
    name: str
    row_block: int = 0  # its linears run on blocks of this many rows: steps pad to a multiple (0: to MIN_STEP_ROWS)
    fused: Any = None  # a fused_bert.FusedEncoder that runs the layers instead of transformers' modules, or None


def is_pooling_model(model: str) -> bool:
    """Whether the model name or directory is a pooling (embedding) model: a sentence-transformers
    directory (``modules.json``) or an architecture with no LM head. GGUF files are chat models."""
    path = _model_path(model)
    if path.is_file():
        return False
    if (path / "modules.json").exists():
        return True
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    return bool(archs) and not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)


def load_encoder(config: EngineConfig) -> LoadedEncoder:
    """Load a pooling model from a directory or a built-in name (never from a hub)."""
    from transformers import AutoModel, AutoTokenizer

    register()
    path: Path = _model_path(config.model)
    if path.is_file():
        raise ValueError(f"{path} is a GGUF file; pooling models load from a directory")
    dev = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, dev)
    t0 = time.perf_counter()
    common: dict[str, Any] = dict(trust_remote_code=config.trust_remote_code, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), **common)
    model = AutoModel.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **common)
    model.to(dev).eval()
    model.requires_grad_(False)
    fused = None
    if dev.type == "cpu" and dtype == torch.bfloat16:
        from batchery.engine import fused_bert

        fused = fused_bert.install(model, dtype, dev)  # BERT encoders: seven kernel calls a layer (fused_bert)
    if fused is None and dev.type == "cpu" and dtype == torch.bfloat16:
        from batchery.engine import fast_linear

        # bf16: every row count through our kernels (no calibrated hand-over to oneDNN at many rows), so a row's
        # sums do not depend on how many rows share the step; on AVX512-BF16 they ran about 1.9x torch's on this
        # model (2-core EPYC, shared machine). fp32 stays on MKL: forcing the fp32 kernel at 1,000-row steps ran
        # 5x slower, so fp32 runs MKL on fixed row blocks instead (below). BATCHERY_CPU_KERNELS=0: torch
        fast_linear.install(model, max_rows=-1)
        _install_fused_gelu(model)
    row_block = ROW_BLOCK if dev.type == "cpu" and dtype == torch.float32 else 0
    if row_block:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.forward = _blocked_linear(module)  # type: ignore[method-assign]
    hf_config = model.config
    is_causal = bool(getattr(hf_config, "is_decoder", False)) or getattr(hf_config, "model_type", "") not in _ENCODERS
    pooler = read_pooler_config(path, hf_config, is_causal)
    if config.max_model_len is not None and config.max_model_len < pooler.max_seq_len:  # never past the model's own
        pooler = PoolerConfig(
            pooler.method, pooler.normalize, pooler.hidden_size, config.max_model_len, pooler.matryoshka_dims
        )
    log.info(
        "loaded pooling model %s (%s, %s pooling%s, %d tokens at most) in %.2f s",
        config.model,
        str(dtype).removeprefix("torch."),
        pooler.method,
        ", normalized" if pooler.normalize else "",
        pooler.max_seq_len,
        time.perf_counter() - t0,
    )
    return LoadedEncoder(model, tokenizer, hf_config, pooler, dtype, dev, is_causal, config.model, row_block, fused)


def _install_fused_gelu(model: torch.nn.Module) -> int:
    """bf16 on the CPU: each intermediate block whose activation is the exact GELU (BertIntermediate: ``dense`` then
    ``intermediate_act_fn``) applies it in place on the projection's fresh output with ``cpu_fused.fused_gelu``, one
    vectorized pass instead of torch's bf16 GELU (7% of a bf16 all-MiniLM-L6-v2 pass on the 2-core Zen 4 EPYC).
    Returns how many blocks it took (0 without the kernels)."""
    from transformers.activations import GELUActivation

    from batchery.engine import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        return 0
    count = 0
    for module in model.modules():
        act, dense = getattr(module, "intermediate_act_fn", None), getattr(module, "dense", None)
        if type(act) is not GELUActivation or act.act is not F.gelu or not isinstance(dense, torch.nn.Linear):
            continue

        def forward(hidden_states: torch.Tensor, dense: torch.nn.Linear = dense) -> torch.Tensor:
            h = dense(hidden_states)
            return kernels.fused_gelu(h) if h.is_contiguous() else F.gelu(h)

        module.forward = forward
        count += 1
    return count


def _blocked_linear(module: torch.nn.Linear) -> Any:
    """``module``'s forward on blocks of exactly ``ROW_BLOCK`` rows (the runner pads every step to a multiple),
    so MKL runs one GEMM shape whatever the step holds (see the module docstring)."""
    weight, bias = module.weight, module.bias

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if n % ROW_BLOCK:
            return F.linear(x, weight, bias)  # not a padded step (a caller of its own): as torch does
        out = rows.new_empty(n, weight.shape[0])
        for start in range(0, n, ROW_BLOCK):
            out[start : start + ROW_BLOCK] = F.linear(rows[start : start + ROW_BLOCK], weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    return forward


# encoder-only model types (bidirectional attention); any other type is run as a causal decoder
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "camembert", "deberta"})


class EncoderRunner:
    """Runs one packed pooling step: ``execute(token_ids) -> [num_seqs, hidden]`` pooled vectors (fp32)."""

    def __init__(self, loaded: LoadedEncoder) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.pad_id = int(getattr(loaded.hf_config, "pad_token_id", None) or 0)
        self.uses_token_types = int(getattr(loaded.hf_config, "type_vocab_size", 0) or 0) > 0
        self.row_block = loaded.row_block

    @torch.inference_mode()
    def execute(self, token_ids: list[list[int]]) -> torch.Tensor:
        seq_lens = [len(t) for t in token_ids]
        flat = [t for ids in token_ids for t in ids]
        positions = [p for n in seq_lens for p in range(n)]
        bounds, start = [], 0
        for n in seq_lens:
            bounds.append((start, n))
            start += n
        target = -(-start // self.row_block) * self.row_block if self.row_block else max(start, MIN_STEP_ROWS)
        if start < target:  # a throwaway segment: the GEMMs see the row counts they always see
            pad = target - start
            flat += [self.pad_id] * pad
            positions += list(range(pad))
            bounds.append((start, pad))
        input_ids = torch.tensor([flat], dtype=torch.long, device=self.device)  # [1, T]
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, T]
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
        if self.uses_token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)  # one sentence per input: type 0
        seqs = cpu_prefill.segments_array(bounds) if self.device.type == "cpu" else None
        fused = self.loaded.fused
        if fused is not None and seqs is not None:
            hidden = fused.forward(input_ids, position_ids, kwargs.get("token_type_ids"), seqs)  # [T, hidden]
            return pool(hidden, seq_lens, self.loaded.pooler)
        _local.segments = _Segments(bounds, self.loaded.is_causal, seqs)
        try:
            hidden = self.model(**kwargs).last_hidden_state[0]  # [T, hidden]
        finally:
            _local.segments = None
        return pool(hidden, seq_lens, self.loaded.pooler)  # [num_seqs, hidden]
