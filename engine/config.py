"""Engine configuration: one frozen dataclass. Derived runtime values (number of KV blocks,
resolved dtype, device) live in the runner's state, never written back here."""

from __future__ import annotations

from dataclasses import dataclass

from batchery.contract.names import ATTENTION_BACKENDS, DEFAULT_MODEL, DTYPES
from batchery.engine.structured import check_json_layout


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None -> the model's max_position_embeddings (capped at 8192)
    block_size: int = 8  # small blocks let more of a shared prefix (the chat template) hit the prefix cache
    num_kv_blocks: int | None = None  # explicit pool size; overrides kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for the KV pool; None -> a default budget
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "triton"
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA + Triton only; see engine/cuda_graphs.py)
    # schedule and pack the next step while the current one runs, its tokens read one step late
    # (``LLMEngine``'s async scheduling): "auto" -> on CUDA only (on the CPU nothing runs meanwhile), True, False
    async_scheduling: bool | str = "auto"
    trust_remote_code: bool = False
    seed: int = 0
    # how structured outputs lay out JSON unless a request names a layout (engine/structured.py, JSON_LAYOUTS):
    # "indent" (json.dumps(indent=2)), "compact" (json.dumps()), "any" (free whitespace), "any:N" (runs of at most N)
    json_layout: str = "indent"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not (isinstance(self.async_scheduling, bool) or self.async_scheduling == "auto"):
            raise ValueError(f"async_scheduling must be 'auto', True or False, got {self.async_scheduling!r}")
        check_json_layout(self.json_layout)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
