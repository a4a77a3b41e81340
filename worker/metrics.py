"""Prometheus metrics of a worker, served at ``/metrics`` on the health port (text exposition).

Where each number comes from, and what it costs on the hot path:

- **Requests** (task threads), from Celery's ``task_prerun``, ``task_postrun`` and ``task_retry``
  signals. prerun stamps the start in a thread-local record and observes the queue wait; postrun
  reads how the attempt ended and its tokens from its return value (a result's ``usage``, or a
  batch line's typed ``LineOutcome``) or its exception (each error type names its ``Outcome``): a
  few operations per request, none per token.
- **Engine steps** (the engine loop thread): ``StepStats.observe`` once per step, a few integer
  adds and three bisects into fixed buckets, with no lock and no prometheus object. A collector
  turns them into histograms and counters when Prometheus scrapes.
- **State**, read at scrape time: KV blocks, running and waiting sequences and the engine state
  from the engine service, and the depth of the worker's queue (``LLEN`` of its lists on the
  broker), cached for ``QUEUE_DEPTH_TTL_S`` so frequent scrapes cost Redis nothing.

**Queue wait.** A Celery message carries no enqueue time, so the publishers stamp one: the
``batchery_enqueued_at`` message header, the publisher's ``time.time()``, set by
``batchery.client.Client`` and the batch publisher (``batchery.broker.publish``). When the task starts, the
worker observes ``now - batchery_enqueued_at``, so the wait includes the time the message sat
prefetched in the worker. Only first attempts are observed: a retry's message waits out its
backoff countdown on purpose. Publisher and worker clocks must agree (NTP); a negative wait (clock
skew) counts as 0. Messages from other publishers, without the header, are not observed.

Engine counters (steps, preemptions, prefix-cache tokens) count over the process's lifetime,
across engine rebuilds. Metric names are listed in ``METRICS`` and in docs/operations.md."""

from __future__ import annotations

import logging
import threading
import time

from batchery.broker.connection import is_redis_url, redis_from_url
from batchery.broker.queues import queue_keys
from batchery.contract.errors import BatcheryError
from batchery.contract.names import BATCH_LINE_TASK, BATCH_LINES_TASK, ENQUEUED_AT_HEADER
from batchery.contract.outcomes import ChunkOutcome, LineOutcome, Outcome
from batchery.tasks.quarantine import num_quarantined
from batchery.worker.service.state import EngineState
from batchery.worker.service.step_stats import FixedHistogram, StepStats

log = logging.getLogger("batchery.worker.metrics")

QUEUE_DEPTH_TTL_S = 2.0

WAIT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
DURATION_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
ENGINE_STATES = tuple(s.value for s in EngineState)

# What /metrics exposes (the family names; counters get a _total suffix, histograms _bucket/_sum/_count).
METRICS = {
    "batchery_requests_total": "counter{task,outcome}: task attempts by how they ended",
    "batchery_retries_total": "counter{task}: attempts retried after an engine failure",
    "batchery_prompt_tokens_total": "counter{task}: prompt tokens of finished requests",
    "batchery_generation_tokens_total": "counter{task}: generated tokens of finished requests",
    "batchery_queue_wait_seconds": "histogram{task}: enqueue to task start, first attempts",
    "batchery_request_duration_seconds": "histogram{task}: task start to end, per attempt",
    "batchery_requests_in_flight": "gauge: requests submitted to the engine and not yet resolved",
    "batchery_quarantined_requests_total": "counter: requests put in quarantine (run alone)",
    "batchery_engine_steps_total": "counter: engine steps that scheduled work",
    "batchery_engine_step_seconds": "histogram: wall time of one engine step",
    "batchery_engine_batch_size": "histogram: sequences in one step",
    "batchery_engine_step_tokens": "histogram: tokens (prefill + decode) in one step",
    "batchery_engine_running_seqs": "gauge: sequences running in the engine",
    "batchery_engine_waiting_seqs": "gauge: sequences waiting for KV blocks or budget",
    "batchery_engine_preemptions_total": "counter: sequences preempted (blocks freed, recomputed later)",
    "batchery_engine_failures_total": "counter: engine failures (step raised, watchdog fired)",
    "batchery_engine_restarts_total": "counter: successful engine rebuilds",
    "batchery_engine_state": "gauge{state}: 1 for the engine service's current state",
    "batchery_kv_blocks_used": "gauge: KV cache blocks in use",
    "batchery_kv_blocks_free": "gauge: KV cache blocks free (cached prefix blocks count as free)",
    "batchery_prefix_cache_hit_tokens_total": "counter: prompt tokens served from the prefix cache",
    "batchery_prefix_cache_query_tokens_total": "counter: prompt tokens looked up in the prefix cache",
    "batchery_prefix_cache_hit_rate": "gauge: hit tokens / query tokens over the process lifetime",
    "batchery_queue_depth": "gauge{queue}: messages waiting in the worker's queue on the broker",
    "batchery_worker_info": "info{model,dtype,queue,max_num_seqs}: constant 1",
}


# -- the task threads' side: a thread-local record per running task ----------------------------------
class _Running:
    __slots__ = ("task", "started", "lines")

    def __init__(self, task: str, started: float, lines: int = 1) -> None:
        self.task = task
        self.started = started
        self.lines = lines


_local = threading.local()


OUTCOMES = tuple(o.value for o in Outcome)


def outcome_of(state: str | None, retval) -> Outcome:
    """How a finished attempt ended, from Celery's state and the task's return value (a batch line
    returns a ``LineOutcome``; a failed task's retval is its exception, whose type names its outcome)."""
    if state == "SUCCESS":
        return retval.outcome if isinstance(retval, LineOutcome) else Outcome.SUCCESS
    if state == "RETRY":
        return Outcome.RETRY
    if state == "REJECTED":
        return Outcome.REQUEUED
    if isinstance(retval, BatcheryError):
        return retval.outcome
    return Outcome.INTERNAL_ERROR


def tokens_of(retval) -> tuple[int, int]:
    """(prompt, generated) tokens of a finished attempt: a chat or completion result's ``usage``, or a
    batch line's ``LineOutcome``."""
    if isinstance(retval, (LineOutcome, ChunkOutcome)):
        return retval.prompt_tokens, retval.completion_tokens
    if isinstance(retval, dict):
        usage = retval.get("usage") or {}
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return 0, 0


# -- queue depth -------------------------------------------------------------------------------------
class QueueDepth:
    """Messages waiting in ``queue`` on a Redis broker: the sum of ``LLEN`` over the queue's list
    and its priority lists (kombu keeps one list per priority step). Cached for ``ttl`` seconds;
    ``None`` when the broker is not Redis or does not answer."""

    def __init__(self, broker_url: str, queue: str, ttl: float = QUEUE_DEPTH_TTL_S) -> None:
        self.url = broker_url
        self.queue = queue
        self.ttl = ttl
        self.keys = queue_keys(queue)
        self.enabled = is_redis_url(broker_url)
        self._client = None
        self._lock = threading.Lock()
        self._value: int | None = None
        self._at = float("-inf")

    def get(self) -> int | None:
        if not self.enabled:
            return None
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl:
                self._value = self._read()
                self._at = time.monotonic()
            return self._value

    def _read(self) -> int | None:
        import redis

        try:
            if self._client is None:
                self._client = redis_from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
            pipe = self._client.pipeline(transaction=False)
            for key in self.keys:
                pipe.llen(key)
            return int(sum(pipe.execute()))
        except (redis.RedisError, OSError) as exc:
            log.debug("queue depth of %s unavailable: %s", self.queue, exc)
            return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


# -- the endpoint ------------------------------------------------------------------------------------
class WorkerMetrics:
    """The worker's metrics registry. ``connect()`` hooks the Celery signals; ``route`` is the
    ``/metrics`` route for ``batchery.worker.health.HealthServer``."""

    def __init__(self, service, settings, task_names=()) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

        disable_created_metrics()  # no *_created series: they double the output and nobody reads them
        self.service = service
        self.settings = settings
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "batchery_requests", "Task attempts by task and how they ended.", ["task", "outcome"], registry=r
        )
        self.retries = Counter(
            "batchery_retries", "Task attempts retried after an engine failure.", ["task"], registry=r
        )
        self.prompt_tokens = Counter(
            "batchery_prompt_tokens", "Prompt tokens of finished requests.", ["task"], registry=r
        )
        self.generation_tokens = Counter(
            "batchery_generation_tokens", "Generated tokens of finished requests.", ["task"], registry=r
        )
        self.queue_wait = Histogram(
            "batchery_queue_wait_seconds",
            "Enqueue (batchery_enqueued_at header) to task start, first attempts.",
            ["task"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "batchery_request_duration_seconds",
            "Task start to end, per attempt.",
            ["task"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        for name in task_names:  # every series exists from the start, at 0
            self.requests.labels(name, "success")
            for m in (self.retries, self.prompt_tokens, self.generation_tokens, self.queue_wait, self.duration):
                m.labels(name)
        self.queue_depth = QueueDepth(settings.broker_url, settings.queue)
        r.register(_ServiceCollector(self))
        self._connected = False

    # -- Celery signals ----------------------------------------------------------------------------
    def connect(self) -> None:
        from celery import signals

        signals.task_prerun.connect(self._on_prerun, weak=False)
        signals.task_postrun.connect(self._on_postrun, weak=False)
        signals.task_retry.connect(self._on_retry, weak=False)
        self._connected = True

    def disconnect(self) -> None:
        from celery import signals

        if self._connected:
            signals.task_prerun.disconnect(self._on_prerun)
            signals.task_postrun.disconnect(self._on_postrun)
            signals.task_retry.disconnect(self._on_retry)
            self._connected = False
        self.queue_depth.close()

    @staticmethod
    def _ours(task) -> bool:
        return task is not None and str(getattr(task, "name", "")).startswith("batchery.")

    def _on_prerun(self, sender=None, task=None, **kwargs) -> None:
        if not self._ours(task):
            return
        req = task.request
        name, lines = task.name, 1
        if name == BATCH_LINES_TASK:  # a chunk: its lines count as batch lines, each as if it had travelled alone
            chunk = (req.kwargs or {}).get("lines")
            name, lines = BATCH_LINE_TASK, len(chunk) if isinstance(chunk, list) and chunk else 1
        _local.rec = _Running(name, time.perf_counter(), lines)
        enqueued = getattr(req, ENQUEUED_AT_HEADER, None)
        if enqueued is None or (req.retries or 0) or req.eta:
            return
        try:
            wait = time.time() - float(enqueued)
        except (TypeError, ValueError):
            return
        for _ in range(lines):
            self.queue_wait.labels(name).observe(max(0.0, wait))

    def _on_postrun(self, sender=None, task=None, retval=None, state=None, **kwargs) -> None:
        rec = getattr(_local, "rec", None)
        _local.rec = None
        if rec is None or not self._ours(task):
            return
        if isinstance(retval, ChunkOutcome):  # each line counts as a batch line, as if it had travelled alone
            for outcome, n in retval.outcomes.items():
                self.requests.labels(BATCH_LINE_TASK, outcome.value).inc(n)
        else:
            self.requests.labels(rec.task, outcome_of(state, retval).value).inc()
        took = time.perf_counter() - rec.started  # a chunk's lines each count the chunk's time
        for _ in range(rec.lines):
            self.duration.labels(rec.task).observe(took)
        prompt_tokens, generated_tokens = tokens_of(retval) if state == "SUCCESS" else (0, 0)
        if prompt_tokens:
            self.prompt_tokens.labels(rec.task).inc(prompt_tokens)
        if generated_tokens:
            self.generation_tokens.labels(rec.task).inc(generated_tokens)

    def _on_retry(self, sender=None, **kwargs) -> None:
        if self._ours(sender):
            self.retries.labels(sender.name).inc()

    # -- exposition --------------------------------------------------------------------------------
    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")

    def route(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        return 200, self.render(), CONTENT_TYPE_LATEST


class _ServiceCollector:
    """Reads the engine service and the step counters at scrape time."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        service, settings = self.m.service, self.m.settings
        steps: StepStats = service.step_stats
        stats = service.stats()
        engine = stats.get("engine") or {}

        def hist(name: str, doc: str, h: FixedHistogram):
            buckets, total = h.cumulative()
            return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)

        def counter(name: str, doc: str, value):
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value):
            return GaugeMetricFamily(name, doc, value=value)

        yield InfoMetricFamily(
            "batchery_worker",
            "The worker's model and queue.",
            value={
                "model": str(settings.model),
                "dtype": str(stats.get("dtype") or settings.dtype),
                "queue": str(settings.queue),
                "max_num_seqs": str(settings.max_num_seqs),
            },
        )
        state = GaugeMetricFamily(
            "batchery_engine_state", "1 for the engine service's current state.", labels=["state"]
        )
        for s in ENGINE_STATES:
            state.add_metric([s], 1.0 if stats.get("state") == s else 0.0)
        yield state
        yield gauge(
            "batchery_requests_in_flight",
            "Requests submitted to the engine, not yet resolved.",
            stats.get("num_pending", 0),
        )
        yield counter(
            "batchery_quarantined_requests", "Requests put in quarantine (made to run alone).", num_quarantined()
        )
        yield counter("batchery_engine_steps", "Engine steps that scheduled work.", steps.step_seconds.count)
        yield hist("batchery_engine_step_seconds", "Wall time of one engine step.", steps.step_seconds)
        yield hist("batchery_engine_batch_size", "Sequences in one engine step.", steps.batch_size)
        yield hist("batchery_engine_step_tokens", "Tokens (prefill and decode) in one engine step.", steps.step_tokens)
        yield gauge("batchery_engine_running_seqs", "Sequences running in the engine.", engine.get("num_running", 0))
        yield gauge("batchery_engine_waiting_seqs", "Sequences waiting in the engine.", engine.get("num_waiting", 0))
        yield counter("batchery_engine_preemptions", "Sequences preempted (recomputed later).", steps.num_preemptions)
        yield counter(
            "batchery_engine_failures",
            "Engine failures: a step raised or the watchdog fired.",
            stats.get("num_failures", 0),
        )
        yield counter("batchery_engine_restarts", "Successful engine rebuilds.", stats.get("num_rebuilds", 0))
        total = engine.get("kv_blocks_total", 0)
        free = engine.get("kv_blocks_free", 0)
        yield gauge("batchery_kv_blocks_used", "KV cache blocks in use.", total - free)
        yield gauge("batchery_kv_blocks_free", "KV cache blocks free (cached prefix blocks count as free).", free)
        hits, queries = steps.prefix_cache_hit_tokens, steps.prefix_cache_query_tokens
        yield counter("batchery_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", hits)
        yield counter("batchery_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", queries)
        yield gauge(
            "batchery_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / query tokens, process lifetime.",
            hits / queries if queries else 0.0,
        )
        depth = self.m.queue_depth.get()
        if depth is not None:
            g = GaugeMetricFamily(
                "batchery_queue_depth", "Messages waiting in the worker's queue on the broker.", labels=["queue"]
            )
            g.add_metric([str(settings.queue)], depth)
            yield g
