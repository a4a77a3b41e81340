"""What a pooling (embedding) model does after its last layer, and what a request asks of it.

A model directory with a sentence-transformers config (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``) says how its embeddings are made: the pooling (mean, CLS or last token),
whether they are L2-normalized (a ``Normalize`` module), the longest input (``max_seq_length``) and, for
Matryoshka models, the sizes it was trained to be cut to. Without one the defaults follow vLLM's pooling
runner: CLS pooling for encoders, last-token for decoders, normalized.

Pure functions over tensors: the runner calls ``pool`` once per step on the packed hidden states."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("batchery.engine.pooling")

POOLING_METHODS = ("mean", "cls", "last")


@dataclass(frozen=True)
class PoolerConfig:
    """How a model's hidden states become one vector per input."""

    method: str  # "mean" | "cls" | "last"
    normalize: bool  # L2-normalize the pooled vector (before any Matryoshka cut, then again after it)
    hidden_size: int  # the vector's size before any cut
    max_seq_len: int  # the longest input in tokens (specials included)
    # sizes the model was trained to be cut to (``dimensions``); None: only its full size is allowed
    matryoshka_dims: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PoolingParams:
    """What one embedding request asks for (the engine's counterpart of ``SamplingParams``)."""

    dimensions: int | None = None  # Matryoshka: keep the first N values (then normalize again if the model does)
    truncate_prompt_tokens: int | None = None  # keep the last N tokens of a too-long input instead of failing


@dataclass
class EmbeddingOutput:
    """What ``PoolingEngine.step()`` and ``LLM.embed()`` hand back for one finished request."""

    request_id: str
    prompt_token_ids: list[int]  # the input as the engine ran it (after any truncation)
    embedding: list[float]  # the pooled vector; [] when the request failed
    error: str | None = None  # why the request failed (too long, empty, a bad ``dimensions``)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class PoolingRequestOutput:
    """What ``PoolingEngine.step()`` hands back for a request once every one of its inputs is pooled."""

    request_id: str
    outputs: list[EmbeddingOutput]  # one per input, in input order
    finish_reason: str = "stop"  # as a generation request's (the engine service reads it): always "stop"
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(o.num_prompt_tokens for o in self.outputs)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_pooler_config(model_dir: Path | None, hf_config: Any, is_causal: bool) -> PoolerConfig:
    """The pooler of the model at ``model_dir`` (None: no directory, defaults only)."""
    hidden = int(hf_config.hidden_size)
    max_len = int(getattr(hf_config, "max_position_embeddings", 512) or 512)
    method, normalize = ("last" if is_causal else "cls"), True
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    modules = _read_json(model_dir / "modules.json") if model_dir is not None else None
    if model_dir is not None and isinstance(modules, list):
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        normalize = "Normalize" in types
        pooling = types.get("Pooling")
        cfg = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") if pooling else None
        if isinstance(cfg, dict):
            if cfg.get("pooling_mode_mean_tokens"):
                method = "mean"
            elif cfg.get("pooling_mode_cls_token"):
                method = "cls"
            elif cfg.get("pooling_mode_lasttoken"):
                method = "last"
            else:
                modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
                raise ValueError(f"pooling {modes} is not supported (mean, cls and lasttoken are)")
        st = _read_json(model_dir / "sentence_bert_config.json")
        if isinstance(st, dict) and isinstance(st.get("max_seq_length"), int):
            max_len = min(max_len, st["max_seq_length"])
    if model_dir is not None:
        st_cfg = _read_json(model_dir / "config_sentence_transformers.json")
        if isinstance(st_cfg, dict) and dims is None:
            dims = st_cfg.get("matryoshka_dimensions")
    if dims is not None:
        dims = tuple(sorted({int(d) for d in dims if 0 < int(d) <= hidden}))
    return PoolerConfig(method, normalize, hidden, max_len, dims or None)


def check_dimensions(config: PoolerConfig, dimensions: int | None) -> str | None:
    """Why ``dimensions`` cannot be served by this model (None: it can)."""
    if dimensions is None or dimensions == config.hidden_size:
        return None
    if config.matryoshka_dims is None:
        return (
            f"this model does not support dimensions: its embeddings have {config.hidden_size} values and it was "
            "not trained to be cut shorter (no Matryoshka dimensions in its config)"
        )
    if not 1 <= dimensions <= config.hidden_size:
        return f"dimensions must be between 1 and {config.hidden_size}, got {dimensions}"
    return None


def pool(
    hidden: torch.Tensor,  # [num_tokens, hidden] the packed step's last hidden states
    seq_lens: list[int],  # each input's tokens, in packing order
    config: PoolerConfig,
) -> torch.Tensor:
    """One vector per input: [num_seqs, hidden], fp32, normalized if the model normalizes. Each row is
    computed from its own input's rows only, in the same order whatever shares the step."""
    out = []
    start = 0
    for n in seq_lens:
        rows = hidden[start : start + n].float()  # [n, hidden]
        if config.method == "mean":
            v = rows.sum(dim=0) / n
        elif config.method == "cls":
            v = rows[0]
        else:
            v = rows[n - 1]
        out.append(v)
        start += n
    pooled = torch.stack(out)  # [num_seqs, hidden]
    if config.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
    return pooled


def cut(vector: torch.Tensor, dimensions: int | None, config: PoolerConfig) -> torch.Tensor:
    """The first ``dimensions`` values of a pooled [hidden] vector (Matryoshka), normalized again if the
    model normalizes (as sentence-transformers' ``truncate_dim`` and vLLM do)."""
    if dimensions is None or dimensions >= vector.shape[-1]:
        return vector
    v = vector[:dimensions]
    return torch.nn.functional.normalize(v, p=2, dim=-1) if config.normalize else v
