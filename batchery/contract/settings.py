"""Worker settings: one pydantic-settings ``Settings``, env prefix ``BATCHERY_``, nested ``__``.

The top-level names (``BATCHERY_BROKER_URL``, ``BATCHERY_MODEL``, ``BATCHERY_QUEUE``, ...) are part
of the interface. Less common engine knobs live under ``engine`` (``BATCHERY_ENGINE__BLOCK_SIZE``).

This module is imported by the client too, so it stays light: no torch, no engine, no celery."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchery.contract.names import ATTENTION_BACKENDS, DEFAULT_MODEL, DTYPES, QUEUE_PREFIX

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


def mask_url(url: str | None) -> str:
    """``url`` with any password replaced by ``***``, for logs. Never raises."""
    if not url:
        return str(url)
    if ";" in url:  # several addresses (sentinel://...;sentinel://...): each may carry a password
        return ";".join(mask_url(part) for part in url.split(";"))
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
    """Engine knobs beyond the interface names; mirror ``batchery.engine.config.EngineConfig``."""

    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    max_num_batched_tokens: int = Field(
        default=1024, ge=1, description="token budget of one step: decodes first, then prompt chunks"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="context length; unset -> the model's, capped at 8192"
    )
    block_size: int = Field(default=8, ge=1, description="tokens per KV cache block")
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV pool size in blocks; overrides kv_cache_memory"
    )
    kv_cache_memory: int | None = Field(
        default=None,
        ge=1,
        description=(
            "KV pool bytes; unset -> 85% of the GPU memory free after the weights, on CPU 40% of what is available"
        ),
    )
    enable_prefix_caching: bool = Field(default=True, description="share the KV blocks of common prompt prefixes")
    attention_backend: str = Field(
        default="auto", description="auto (C++ kernel on CPU, Triton on CUDA), cpu, torch or triton"
    )
    cuda_graphs: bool = Field(
        default=True, description="replay decode steps from CUDA graphs (CUDA with Triton attention)"
    )
    async_scheduling: bool | Literal["auto"] = Field(
        default="auto",
        description="schedule the next step while the current one runs, tokens read one step late (auto: CUDA only)",
    )
    trust_remote_code: bool = Field(default=False, description="let transformers run a model repo's own code")
    seed: int = Field(default=0, description="sampler seed for requests without their own seed")
    json_layout: str = Field(
        default="indent",
        description=(
            "how structured outputs lay out JSON unless a request names a layout: indent (json.dumps(indent=2)), "
            "compact (one line), any (free whitespace), any:N (runs of at most N whitespace characters)"
        ),
    )

    @field_validator("json_layout")
    @classmethod
    def _check_json_layout(cls, v: str) -> str:
        from batchery.contract.schemas.constraints import check_json_layout

        return check_json_layout(v, "BATCHERY_ENGINE__JSON_LAYOUT")


class BatchOptions(BaseModel):
    """Batch-job limits and bookkeeping (``BATCHERY_BATCH__MAX_LINES`` ...). Used by the submitter
    (line size, lines per job) and by both sides for the job keys in the result backend."""

    max_line_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20, description="bytes per input line")
    max_lines: int = Field(default=10_000_000, ge=1, le=10_000_000, description="request lines per job")
    ttl: int = Field(default=7 * 86400, ge=60, description="seconds a job and its results are kept once it ends")
    key_prefix: str = Field(
        default="batchery:batch", min_length=1, max_length=64, description="Redis key prefix of the job state"
    )
    window_min: int = Field(
        default=2048, ge=16, le=1_000_000, description="floor of a job's window: lines queued or running at once"
    )
    window_max: int = Field(
        default=8192, ge=16, le=1_000_000, description="ceiling of a job's window (it is sized from the live workers)"
    )

    feeder_lease_s: float = Field(
        default=30.0, ge=1.0, le=3600.0, description="seconds without a heartbeat after which a job's feeder is dead"
    )
    chunk_lines: int = Field(
        default=32,
        ge=1,
        le=256,
        description="lines one task message carries at most (1: a message a line)",
    )
    drain_at: int = Field(
        default=4096,
        ge=0,
        le=1_000_000,
        description="records a running job keeps in Redis before workers move them to the store (0: never)",
    )

    @model_validator(mode="after")
    def _window_order(self) -> BatchOptions:
        if self.window_min > self.window_max:
            raise ValueError(
                f"BATCHERY_BATCH__WINDOW_MIN ({self.window_min}) is above BATCHERY_BATCH__WINDOW_MAX "
                f"({self.window_max})"
            )
        return self


class QuarantineOptions(BaseModel):
    """Poison-request quarantine (``BATCHERY_QUARANTINE__AFTER`` ...). A request that was in the
    failing step of ``after`` engine failures runs alone; if it fails alone ``solo_attempts`` times
    in a row, it fails for good with ``engine_crash``. Strikes are kept in the result backend's
    Redis under ``key_prefix``, keyed by task id, so they survive retries on any worker. Needs
    ``BATCHERY_MAX_RETRIES`` >= ``after`` to take effect."""

    after: int = Field(default=2, ge=0, le=100, description="engine failures before running alone; 0 = off")
    solo_attempts: int = Field(default=2, ge=1, le=10, description="failed runs alone before engine_crash")
    key_prefix: str = Field(
        default="batchery:strikes", min_length=1, max_length=64, description="Redis key prefix of the strike counters"
    )


class DeadLetterOptions(BaseModel):
    """Dead letters (``BATCHERY_DEADLETTER__KEY_PREFIX`` ...): messages that failed for good without running
    (``BATCHERY_MAX_DELIVERIES`` deliveries died with their worker process, or a batch-line message failed its
    checks), kept in the result backend's Redis for ``batchery deadletter list / inspect / requeue``."""

    key_prefix: str = Field(
        default="batchery:deadletter", min_length=1, max_length=64, description="Redis key prefix of the dead letters"
    )
    max_entries: int = Field(
        default=1000, ge=1, le=1_000_000, description="dead letters kept; the oldest go first beyond this"
    )
    deliveries_prefix: str = Field(
        default="batchery:deliveries",
        min_length=1,
        max_length=64,
        description="Redis key prefix of the per-task delivery counters",
    )


class ApiOptions(BaseModel):
    """``batchery serve``: OpenAI's Files, Batches, Chat Completions, Completions, Responses and Models
    over HTTP, backed by the queue (``BATCHERY_API__*``)."""

    keys: SecretStr | None = Field(
        default=None,
        description="comma-separated API keys (Bearer); unset -> no auth, and the server listens on localhost only",
    )
    operator_keys: SecretStr | None = Field(
        default=None,
        description="comma-separated keys of the web console's operators (every job, the workers page); not API keys",
    )
    host: str = Field(default="127.0.0.1", description="address batchery serve listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="port batchery serve listens on")
    storage_dir: str = Field(
        default="~/.cache/batchery/files",
        description="uploaded and result files (a directory every API replica can read: a volume in compose)",
    )
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1, description="largest upload, bytes (OpenAI: 200 MB)")
    request_timeout: float = Field(
        default=600.0, gt=0, description="seconds a synchronous chat/completions/responses request may take"
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="largest JSON request body, bytes")
    key_prefix: str = Field(
        default="batchery:api", min_length=1, max_length=64, description="Redis key prefix of files and batches"
    )

    def key_list(self) -> list[str]:
        """The configured keys (empty: no auth). Never logged."""
        if self.keys is None:
            return []
        return [k.strip() for k in self.keys.get_secret_value().split(",") if k.strip()]

    def operator_key_list(self) -> list[str]:
        """The web console's operator keys (empty: none). Never logged."""
        if self.operator_keys is None:
            return []
        return [k.strip() for k in self.operator_keys.get_secret_value().split(",") if k.strip()]


class Settings(BaseSettings):
    """Everything a worker (and a client) needs, from ``BATCHERY_*`` environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="BATCHERY_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    # transport
    broker_url: str = Field(
        default=DEFAULT_BROKER_URL, description="Redis URL: redis://:PASSWORD@host:6379/0, rediss:// for TLS"
    )
    result_backend: str | None = Field(default=None, description="results and batch jobs; unset -> the broker URL")
    queue: str | None = Field(default=None, description="the queue; unset -> batchery.<model name>")
    result_expires: int = Field(default=86400, ge=1, description="seconds results stay in the backend")
    storage_url: str = Field(
        default="~/.cache/batchery/store",
        description="the file store of big jobs' inputs and records: a directory (or file:// URL) that submitters, "
        "readers and workers share (a volume in compose)",
    )

    # model and engine
    model: str = Field(default=DEFAULT_MODEL, description="model name, Hugging Face directory or .gguf file")
    dtype: str = Field(default="auto", description="auto, float32, bfloat16 or float16")
    max_num_seqs: int = Field(default=128, ge=1, description="sequences batched together in one engine step")
    engine: EngineOptions = Field(default_factory=EngineOptions)
    batch: BatchOptions = Field(default_factory=BatchOptions)
    quarantine: QuarantineOptions = Field(default_factory=QuarantineOptions)
    deadletter: DeadLetterOptions = Field(default_factory=DeadLetterOptions)
    api: ApiOptions = Field(default_factory=ApiOptions)

    # tasks
    concurrency: int | None = Field(default=None, ge=1, description="task threads; None -> max_num_seqs + 25%")
    task_timeout: float = Field(default=600.0, gt=0, description="default per-attempt deadline, seconds")
    max_task_timeout: float = Field(default=3600.0, gt=0, description="largest deadline a client may ask for")
    max_retries: int = Field(default=3, ge=0, description="retries after an engine failure")
    max_deliveries: int = Field(
        default=3,
        ge=0,
        le=100,
        description="deliveries of a request that died with their worker process before it is dead-lettered "
        "(from the second on it runs alone); 0 = off",
    )
    retry_backoff: float = Field(default=1.0, gt=0, description="first retry delay, seconds; doubles each time")
    retry_backoff_max: float = Field(default=60.0, gt=0, description="longest retry delay, seconds")
    visibility_timeout: float | None = Field(
        default=None,
        gt=0,
        description="unacked messages are redelivered after this; unset -> 2 x max_task_timeout + retry_backoff_max",
    )
    batch_wait: float = Field(
        default=0.1, ge=0, le=10, description="idle engine: at most this long to let a burst arrive"
    )
    shutdown_grace: float = Field(default=30.0, ge=0, description="on SIGTERM, seconds in-flight work may finish")

    # supervision
    watchdog_timeout: float = Field(default=300.0, gt=0, description="work pending, no step for this long = failed")
    max_rebuilds: int = Field(default=3, ge=1, description="consecutive failed rebuilds before the worker gives up")
    prefix_affinity: bool = Field(
        default=True,
        description="with several workers on a queue, a batch job's lines that share a prompt prefix run on one "
        "of them (each worker also consumes a queue of its own); off: each line runs where it lands",
    )
    recovery_interval: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="seconds between a worker's looks for batch lines whose messages the broker lost (one worker "
        "of a queue at a time; jobs quiet for that long); 0 = off",
    )
    orphan_grace: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="seconds after its delivery that a message held by a worker gone from the workers' presence "
        "(killed, OOM) goes back to its queue, instead of after the visibility timeout; 0 = off",
    )
    faults: str = Field(
        default="", description="fault injection for rehearsals (worker/service/faults.py); empty = none"
    )

    # ops
    health_host: str = Field(default="0.0.0.0", description="address of the health and metrics server")
    health_port: int = Field(default=8080, ge=0, le=65535, description="/healthz, /readyz, /stats, /metrics; 0 = off")
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    log_format: str = Field(default="text", description="text, or json for one JSON object per line")
    send_events: bool = Field(default=False, description="Celery task events and worker heartbeats (Flower)")
    hostname: str | None = Field(default=None, description="Celery node name; unset -> batchery-<pid>@<host>")

    @model_validator(mode="after")
    def _derive_and_check(self) -> Settings:
        if self.result_backend is None:
            self.result_backend = self.broker_url
        if not self.queue:
            self.queue = queue_for_model(self.model)
        self.log_level, self.log_format = self.log_level.upper(), self.log_format.lower()
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(
                f"BATCHERY_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {self.log_level!r}"
            )
        if self.log_format not in ("text", "json"):
            raise ValueError(f"BATCHERY_LOG_FORMAT must be text or json, got {self.log_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"BATCHERY_DTYPE must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.engine.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"BATCHERY_ENGINE__ATTENTION_BACKEND must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.engine.attention_backend!r}"
            )
        if self.task_timeout > self.max_task_timeout:
            raise ValueError(
                f"BATCHERY_TASK_TIMEOUT ({self.task_timeout}) exceeds "
                f"BATCHERY_MAX_TASK_TIMEOUT ({self.max_task_timeout})"
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

    def engine_kwargs(self) -> dict:
        """The keyword arguments of this worker's ``EngineConfig`` (the contract knows no engine types)."""
        e = self.engine
        return dict(
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
            cuda_graphs=e.cuda_graphs,
            async_scheduling=e.async_scheduling,
            trust_remote_code=e.trust_remote_code,
            seed=e.seed,
            json_layout=e.json_layout,
        )

    def describe(self) -> dict:
        """Settings safe to log: URLs masked."""
        d = self.model_dump()
        d["broker_url"] = mask_url(self.broker_url)
        d["result_backend"] = mask_url(self.result_backend)
        return d


# -- the worker's command-line flags (``batchery worker`` and ``python -m batchery.worker``) -------------
WORKER_DESCRIPTION = (
    "Run a worker: load the model, then consume its queue. Configured by BATCHERY_* variables; "
    "the flags below override them."
)
# flag, Settings field, type, help
WORKER_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--model", "model", str, "model name, local HF directory or .gguf file (BATCHERY_MODEL)"),
    ("--queue", "queue", str, "queue to consume (BATCHERY_QUEUE; default derived from the model)"),
    ("--concurrency", "concurrency", int, "task threads (BATCHERY_CONCURRENCY)"),
    ("--health-port", "health_port", int, "health endpoint port; 0 disables (BATCHERY_HEALTH_PORT)"),
    ("--log-level", "log_level", str, "DEBUG, INFO, WARNING, ... (BATCHERY_LOG_LEVEL)"),
)


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The worker's flags on ``p``: each overrides one ``Settings`` field."""
    p.description = WORKER_DESCRIPTION
    for flag, dest, typ, help_text in WORKER_FLAGS:
        p.add_argument(flag, dest=dest, type=typ, help=help_text)


def worker_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``Settings`` overrides the worker's flags in ``args`` ask for."""
    return {dest: getattr(args, dest) for _flag, dest, _typ, _help in WORKER_FLAGS if getattr(args, dest) is not None}


def worker_argv(overrides: dict[str, object]) -> list[str]:
    """The flags that ask for ``overrides`` again (to hand them to another process)."""
    return [
        part for flag, dest, _typ, _help in WORKER_FLAGS if dest in overrides for part in (flag, str(overrides[dest]))
    ]


# -- the configuration table (docs/operations.md) ------------------------------------------------------
def _shown(value: object) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if value != "" else "(empty)"


def env_variables() -> list[tuple[str, str, str]]:
    """``(variable, default, description)`` for every ``BATCHERY_*`` variable ``Settings`` reads,
    nested options (``BATCHERY_ENGINE__BLOCK_SIZE``) included, in declaration order."""
    rows = []
    for name, field in Settings.model_fields.items():
        nested = (
            field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
        )
        if nested is None:
            rows.append(
                (
                    f"BATCHERY_{name.upper()}",
                    _shown(field.get_default(call_default_factory=True)),
                    field.description or "",
                )
            )
            continue
        for sub, f in nested.model_fields.items():
            rows.append(
                (
                    f"BATCHERY_{name.upper()}__{sub.upper()}",
                    _shown(f.get_default(call_default_factory=True)),
                    f.description or "",
                )
            )
    return rows


def env_table() -> str:
    """The Markdown table of ``env_variables()``: ``python -m batchery.contract.settings --table``."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for var, default, doc in env_variables():
        doc = doc.replace("|", "/").replace("<", "\\<")  # Markdown: a cell ends at |, <x> is a tag
        lines.append(f"| `{var}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--table"]:
        sys.exit("usage: python -m batchery.contract.settings --table   (the BATCHERY_* variables as a Markdown table)")
    sys.stdout.write(env_table())
