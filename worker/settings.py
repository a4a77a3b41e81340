"""Worker settings: one pydantic-settings ``Settings``, env prefix ``BATCHERY_``, nested ``__``.

The top-level names (``BATCHERY_BROKER_URL``, ``BATCHERY_MODEL``, ``BATCHERY_QUEUE``, ...) are part
of the interface. Less common engine knobs live under ``engine`` (``BATCHERY_ENGINE__BLOCK_SIZE``).

This module is imported by the client too, so it stays light: no torch, no engine, no celery."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MODEL = "smollm2-135m-instruct"
QUEUE_PREFIX = "batchery."


def mask_url(url: str | None) -> str:
    """``url`` with any password replaced by ``***``, for logs. Never raises."""
    if not url:
        return str(url)
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        # unparseable: hide everything between "://" and the last "@"
        return re.sub(r"(://)[^/]*@", r"\1***@", url)


def queue_for_model(model: str) -> str:
    """The default queue for a model: ``batchery.<name>`` where name is the model's base name
    (a local path or .gguf file counts by its last component), lower-cased and sanitised."""
    name = model.rstrip("/\\")
    if "/" in name or "\\" in name or name.endswith(".gguf"):
        name = Path(name).name.removesuffix(".gguf")
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"
    return QUEUE_PREFIX + name


class EngineOptions(BaseModel):
    """Engine knobs beyond the interface names; mirror ``engine.config.EngineConfig``."""

    device: str = "auto"
    max_num_batched_tokens: int = Field(default=1024, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    trust_remote_code: bool = False
    seed: int = 0


class BatchOptions(BaseModel):
    """Batch-job limits and bookkeeping (``BATCHERY_BATCH__MAX_LINES`` ...). Used by the submitter
    (line size, lines per job) and by both sides for the job keys in the result backend."""

    max_line_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20, description="bytes per input line")
    max_lines: int = Field(default=100_000, ge=1, le=10_000_000, description="request lines per job")
    ttl: int = Field(default=7 * 86400, ge=60, description="seconds a job and its results are kept once it ends")
    key_prefix: str = Field(default="batchery:batch", min_length=1, max_length=64)


class Settings(BaseSettings):
    """Everything a worker (and a client) needs, from ``BATCHERY_*`` environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="BATCHERY_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    # transport
    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str | None = None  # None -> the broker URL
    queue: str | None = None  # None -> derived from the model (queue_for_model)
    result_expires: int = Field(default=86400, ge=1, description="seconds results stay in the backend")

    # model and engine
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_num_seqs: int = Field(default=128, ge=1)
    engine: EngineOptions = Field(default_factory=EngineOptions)
    batch: BatchOptions = Field(default_factory=BatchOptions)

    # tasks
    concurrency: int | None = Field(default=None, ge=1, description="task threads; None -> max_num_seqs + 25%")
    task_timeout: float = Field(default=600.0, gt=0, description="default per-attempt deadline, seconds")
    max_task_timeout: float = Field(default=3600.0, gt=0, description="largest deadline a client may ask for")
    max_retries: int = Field(default=3, ge=0, description="retries after an engine failure")
    retry_backoff: float = Field(default=1.0, gt=0, description="first retry delay, seconds; doubles each time")
    retry_backoff_max: float = Field(default=60.0, gt=0)
    visibility_timeout: float | None = Field(default=None, gt=0, description="None -> 2 x max_task_timeout")
    batch_wait: float = Field(default=0.1, ge=0, le=10, description="idle engine: at most this long to let a burst arrive")
    shutdown_grace: float = Field(default=30.0, ge=0, description="on SIGTERM, seconds in-flight work may finish")

    # supervision
    watchdog_timeout: float = Field(default=300.0, gt=0, description="work pending, no step for this long = failed")
    max_rebuilds: int = Field(default=3, ge=1, description="consecutive failed rebuilds before the worker gives up")
    faults: str = ""

    # ops
    health_host: str = "0.0.0.0"
    health_port: int = Field(default=8080, ge=0, le=65535, description="0 -> health server disabled")
    log_level: str = "INFO"
    send_events: bool = Field(default=False, description="Celery task events and worker heartbeats (Flower)")
    hostname: str | None = None  # Celery node name; None -> batchery-<pid>@<host>

    @model_validator(mode="after")
    def _derive_and_check(self) -> Settings:
        if self.result_backend is None:
            self.result_backend = self.broker_url
        if not self.queue:
            self.queue = queue_for_model(self.model)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"BATCHERY_DTYPE must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.task_timeout > self.max_task_timeout:
            raise ValueError(
                f"BATCHERY_TASK_TIMEOUT ({self.task_timeout}) exceeds BATCHERY_MAX_TASK_TIMEOUT ({self.max_task_timeout})"
            )
        if self.visibility_timeout is None:
            self.visibility_timeout = 2 * self.max_task_timeout + self.retry_backoff_max
        # An unacked message is redelivered after visibility_timeout even while a worker still runs
        # it, so it must outlast the longest deadline plus the longest retry countdown it may sit on.
        longest = self.max_task_timeout + self.retry_backoff_max
        if self.visibility_timeout <= longest:
            raise ValueError(
                f"BATCHERY_VISIBILITY_TIMEOUT ({self.visibility_timeout:g} s) must exceed the longest deadline "
                f"plus retry delay ({self.max_task_timeout:g} + {self.retry_backoff_max:g} s); raise it or lower "
                "BATCHERY_MAX_TASK_TIMEOUT"
            )
        if self.batch_wait >= self.watchdog_timeout:
            raise ValueError("BATCHERY_BATCH_WAIT must be shorter than BATCHERY_WATCHDOG_TIMEOUT")
        if self.retry_backoff > self.retry_backoff_max:
            raise ValueError("BATCHERY_RETRY_BACKOFF must not exceed BATCHERY_RETRY_BACKOFF_MAX")
        return self

    @property
    def num_task_threads(self) -> int:
        # a little more than the batch, so finished slots are refilled from already-fetched work
        return self.concurrency or self.max_num_seqs + max(1, self.max_num_seqs // 4)

    def engine_config(self):
        """The frozen ``EngineConfig`` for this worker (imported lazily: settings stay light)."""
        from engine.config import EngineConfig

        e = self.engine
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=e.device,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_model_len=e.max_model_len,
            block_size=e.block_size,
            num_kv_blocks=e.num_kv_blocks,
            kv_cache_memory=e.kv_cache_memory,
            enable_prefix_caching=e.enable_prefix_caching,
            attention_backend=e.attention_backend,
            trust_remote_code=e.trust_remote_code,
            seed=e.seed,
        )

    def describe(self) -> dict:
        """Settings safe to log: URLs masked."""
        d = self.model_dump()
        d["broker_url"] = mask_url(self.broker_url)
        d["result_backend"] = mask_url(self.result_backend)
        return d
