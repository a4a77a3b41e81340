"""Prometheus metrics: ``/metrics`` of real workers (tiny model) after real requests, and the
pieces behind it (step counters, queue depth on the real Redis, outcome labels).

1. after chat, completion, invalid and batch requests the counters moved by exactly what the
   responses say: requests by task and outcome, prompt and generated tokens, queue waits,
   steps, batch sizes, KV blocks, prefix-cache hits;
2. an engine failure and a small KV pool move the failure, restart, retry and preemption counters;
3. the queue depth is the sum over the queue's priority lists, cached between scrapes."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest
from conftest import TEST_BROKER_URL, redis_client, wait_for
from prometheus_client.parser import text_string_to_metric_families

from batchery.contract.errors import ContextLengthExceeded, DeadlineExceeded, EngineCrash, EngineFailure, InvalidRequest
from batchery.contract.names import BATCH_LINE_TASK, CHAT_TASK, COMPLETION_TASK
from batchery.contract.outcomes import LineOutcome, Outcome
from batchery.worker.metrics import METRICS, FixedHistogram, QueueDepth, StepStats, outcome_of

SYSTEM = " ".join(["you are a good model that can write a long story about the cat and the dog by the sea"] * 3)


class Scrape:
    """One scrape of ``/metrics``: ``s["name", {"label": "value"}]`` is a sample's value."""

    def __init__(self, text: str, content_type: str = "") -> None:
        self.text = text
        self.content_type = content_type
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for f in self.families.values() for s in f.samples
        }

    def __getitem__(self, key) -> float:
        name, labels = key if isinstance(key, tuple) else (key, {})
        return self.samples[(name, tuple(sorted(labels.items())))]

    def get(self, name: str, default: float = 0.0, **labels) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), default)


def scrape(worker) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.health_port}/metrics", timeout=10) as r:
        return Scrape(r.read().decode(), r.headers.get("Content-Type", ""))


def delta(after: Scrape, before: Scrape, name: str, **labels) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def chat(content: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


# -- 1. a real worker after real requests ---------------------------------------------------------------
def test_counters_move_by_what_the_requests_did(tiny_worker, tiny_client):
    before = scrape(tiny_worker)
    # one first, so the shared system prompt's blocks are cached before the others arrive
    first = tiny_client.chat(chat("hello world"), max_tokens=6, temperature=0, ignore_eos=True).get(timeout=60)
    rest = [
        h.get(timeout=60)
        for h in tiny_client.chat_many(
            [chat("the cat"), chat("the dog and the sea"), chat("write a story")], max_tokens=8, temperature=0
        )
    ]
    tiny_client.complete("once upon a time", max_tokens=5, ignore_eos=True).get(timeout=60)
    # an invalid body only a worker sees (the client validates before sending): no enqueue stamp
    bad = tiny_client.app.send_task(CHAT_TASK, kwargs={"body": {"messages": "not a list"}}, queue=tiny_client.queue)
    with pytest.raises(InvalidRequest):
        bad.get(timeout=60)
    lines = [
        {
            "custom_id": f"m-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": chat(f"hi {i}"), "max_tokens": 3, "temperature": 0},
        }
        for i in range(3)
    ]
    lines.append(
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "hello " * 9000, "max_tokens": 2},
        }
    )
    job = tiny_client.submit_batch(lines)
    try:
        st = tiny_client.wait_batch(job, timeout=60)
        assert (st.request_counts.completed, st.request_counts.failed) == (3, 1)
        records = list(tiny_client.batch_results(job))
    finally:
        tiny_client.jobs.delete(job)
    wait_for(lambda: scrape(tiny_worker).get("batchery_requests_in_flight") == 0, 10, what="nothing in flight")
    after = scrape(tiny_worker)

    chats = [first, *rest]
    # requests by task and outcome
    assert delta(after, before, "batchery_requests_total", task=CHAT_TASK, outcome="success") == 4
    assert delta(after, before, "batchery_requests_total", task=CHAT_TASK, outcome="invalid_request") == 1
    assert delta(after, before, "batchery_requests_total", task=COMPLETION_TASK, outcome="success") == 1
    assert delta(after, before, "batchery_requests_total", task=BATCH_LINE_TASK, outcome="success") == 3
    assert delta(after, before, "batchery_requests_total", task=BATCH_LINE_TASK, outcome="context_length_exceeded") == 1
    assert delta(after, before, "batchery_request_duration_seconds_count", task=CHAT_TASK) == 5
    # tokens: exactly the responses' usage
    assert delta(after, before, "batchery_prompt_tokens_total", task=CHAT_TASK) == sum(
        r.usage.prompt_tokens for r in chats
    )
    assert delta(after, before, "batchery_generation_tokens_total", task=CHAT_TASK) == sum(
        r.usage.completion_tokens for r in chats
    )
    assert delta(after, before, "batchery_generation_tokens_total", task=COMPLETION_TASK) == 5
    ok_lines = [r for r in records if r["error"] is None]
    assert delta(after, before, "batchery_prompt_tokens_total", task=BATCH_LINE_TASK) == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in ok_lines
    )
    # queue wait: every request the client or the batch publisher stamped, not the raw send_task
    assert delta(after, before, "batchery_queue_wait_seconds_count", task=CHAT_TASK) == 4
    assert delta(after, before, "batchery_queue_wait_seconds_count", task=COMPLETION_TASK) == 1
    assert delta(after, before, "batchery_queue_wait_seconds_count", task=BATCH_LINE_TASK) == 4
    assert 0 < delta(after, before, "batchery_queue_wait_seconds_sum", task=CHAT_TASK) < 60
    # engine steps: one observation per step in every step histogram
    steps = delta(after, before, "batchery_engine_steps_total")
    assert steps > 0
    for h in ("batchery_engine_step_seconds", "batchery_engine_batch_size", "batchery_engine_step_tokens"):
        assert after[f"{h}_count"] == after["batchery_engine_steps_total"], h
        assert after[f"{h}_bucket", {"le": "+Inf"}] == after[f"{h}_count"], h
    assert delta(after, before, "batchery_engine_step_seconds_sum") > 0
    # every generated token came out of one sequence in one step; every scheduled sequence had a token
    generated = sum(
        delta(after, before, "batchery_generation_tokens_total", task=t)
        for t in (CHAT_TASK, COMPLETION_TASK, BATCH_LINE_TASK)
    )
    seqs = delta(after, before, "batchery_engine_batch_size_sum")
    assert seqs >= generated
    assert delta(after, before, "batchery_engine_step_tokens_sum") >= seqs
    # prefix cache: the system prompt was computed once and reused
    hits = delta(after, before, "batchery_prefix_cache_hit_tokens_total")
    assert hits >= 3 * 16  # three later chats reused at least a full block each
    assert delta(after, before, "batchery_prefix_cache_query_tokens_total") >= hits
    assert after["batchery_prefix_cache_hit_rate"] == pytest.approx(
        after["batchery_prefix_cache_hit_tokens_total"] / after["batchery_prefix_cache_query_tokens_total"]
    )
    # state gauges
    assert after["batchery_kv_blocks_used"] + after["batchery_kv_blocks_free"] == 2048
    assert after["batchery_kv_blocks_used"] == 0  # nothing running: every block is free (some cached)
    assert after["batchery_engine_running_seqs"] == after["batchery_engine_waiting_seqs"] == 0
    assert after["batchery_engine_state", {"state": "serving"}] == 1
    assert after["batchery_engine_state", {"state": "rebuilding"}] == 0
    assert after["batchery_queue_depth", {"queue": tiny_worker.queue}] == 0
    info = next(s for f in after.families.values() for s in f.samples if s.name == "batchery_worker_info")
    assert info.labels["queue"] == tiny_worker.queue and info.labels["dtype"] == "float32" and info.value == 1


def test_exposition_is_prometheus_text_with_every_documented_family(tiny_worker):
    s = scrape(tiny_worker)
    assert s.content_type.startswith("text/plain") and "version=" in s.content_type
    exposed = set()
    for f in s.families.values():
        exposed |= {sample.name for sample in f.samples}
    for name in METRICS:
        if name.endswith(("_seconds", "_size", "_tokens")) and f"{name}_count" in exposed:
            continue  # a histogram
        assert name in exposed, f"{name} is not exposed"
    assert not [n for n in exposed if n.endswith("_created")]  # no noise series
    assert (
        "# HELP batchery_engine_step_seconds " in s.text and "# TYPE batchery_engine_step_seconds histogram" in s.text
    )


# -- 2. failures, retries and preemption on a dedicated worker ------------------------------------------
def test_engine_failure_and_a_small_kv_pool_move_restart_retry_and_preemption_counters(workers):
    # 16 blocks of 16 tokens: eight 60-token sequences cannot all fit, so the scheduler preempts;
    # the third step raises once, so the engine is rebuilt and its requests are retried
    w = workers.spawn(
        BATCHERY_FAULTS="step_raise:3",
        BATCHERY_ENGINE__NUM_KV_BLOCKS="16",
        BATCHERY_ENGINE__MAX_MODEL_LEN="128",
        BATCHERY_BATCH_WAIT="0.2",
    )
    before = scrape(w)
    assert before["batchery_engine_restarts_total"] == before["batchery_engine_failures_total"] == 0
    c = workers.client(w.queue)
    try:
        hs = c.chat_many(
            [
                [{"role": "user", "content": f"write a long story about the {x}"}]
                for x in ("cat", "dog", "sea", "sky", "city", "river", "tree", "rain")
            ],
            max_tokens=48,
            ignore_eos=True,
            temperature=0,
        )
        results = [h.get(timeout=120) for h in hs]
    finally:
        c.close()
    assert all(r.usage.completion_tokens == 48 for r in results)
    wait_for(lambda: scrape(w).get("batchery_requests_in_flight") == 0, 10, what="nothing in flight")
    after = scrape(w)
    assert after["batchery_engine_failures_total"] == 1
    assert after["batchery_engine_restarts_total"] == 1
    retried = after["batchery_retries_total", {"task": CHAT_TASK}]
    assert retried >= 1
    assert after["batchery_requests_total", {"task": CHAT_TASK, "outcome": "retry"}] == retried
    assert after["batchery_requests_total", {"task": CHAT_TASK, "outcome": "success"}] == 8
    assert after["batchery_engine_preemptions_total"] >= 1
    assert after["batchery_kv_blocks_used"] + after["batchery_kv_blocks_free"] == 16
    # retried attempts do not count a queue wait again: one per request
    assert after["batchery_queue_wait_seconds_count", {"task": CHAT_TASK}] == 8
    assert after["batchery_generation_tokens_total", {"task": CHAT_TASK}] == 8 * 48


# -- 3. the parts --------------------------------------------------------------------------------------------
def test_queue_depth_sums_the_priority_lists_and_is_cached(redis_urls):
    queue = f"batchery-test-depth-{uuid.uuid4().hex[:8]}"
    r = redis_client(TEST_BROKER_URL)
    keys = [queue, f"{queue}\x06\x163", f"{queue}\x06\x169"]
    try:
        r.lpush(keys[0], "a", "b")
        r.lpush(keys[1], "c")
        r.lpush(keys[2], "d", "e", "f")
        fresh = QueueDepth(TEST_BROKER_URL, queue, ttl=0)
        cached = QueueDepth(TEST_BROKER_URL, queue, ttl=60)
        assert fresh.get() == cached.get() == 6
        r.rpop(keys[2])
        assert fresh.get() == 5
        assert cached.get() == 6  # within its ttl: no Redis round trip
        fresh.close()
        cached.close()
    finally:
        r.delete(*keys)
    t0 = time.monotonic()
    down = QueueDepth("redis://127.0.0.1:1/0", queue)
    assert down.get() is None and time.monotonic() - t0 < 5  # an unreachable broker costs a scrape little
    assert QueueDepth("memory://", queue).get() is None  # not Redis: no depth


def test_step_stats_keep_counting_across_engine_rebuilds():
    s = StepStats()
    stats = {
        "last_step_num_seqs": 3,
        "last_step_num_tokens": 40,
        "num_preemptions": 2,
        "prefix_cache_hit_tokens": 16,
        "prefix_cache_query_tokens": 50,
    }
    s.observe(0, 0.003, stats)
    s.observe(0, 0.2, {**stats, "num_preemptions": 5, "prefix_cache_hit_tokens": 32, "prefix_cache_query_tokens": 60})
    # a rebuilt engine (generation 1) starts its own counters from zero
    s.observe(1, 0.004, {**stats, "num_preemptions": 1, "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 7})
    assert (s.num_preemptions, s.prefix_cache_hit_tokens, s.prefix_cache_query_tokens) == (6, 32, 67)
    buckets, total = s.step_seconds.cumulative()
    assert dict(buckets)["0.0025"] == 0 and dict(buckets)["0.005"] == 2 and dict(buckets)["+Inf"] == 3
    assert total == pytest.approx(0.207) and s.step_seconds.count == 3
    assert dict(s.batch_size.cumulative()[0])["4.0"] == 3


def test_fixed_histogram_bounds_are_inclusive():
    h = FixedHistogram((1, 2))
    for v in (0, 1, 1.5, 2, 3):
        h.observe(v)
    assert h.cumulative()[0] == [("1.0", 2), ("2.0", 4), ("+Inf", 5)]


@pytest.mark.parametrize(
    "state, retval, outcome",
    [
        ("SUCCESS", {"id": "x"}, "success"),
        ("SUCCESS", LineOutcome(Outcome.SUCCESS, "job in_progress"), "success"),
        ("SUCCESS", LineOutcome(Outcome.SKIPPED, "done"), "skipped"),
        ("SUCCESS", LineOutcome(Outcome.CANCELLED), "cancelled"),
        ("SUCCESS", LineOutcome(Outcome.DEADLINE_EXCEEDED, "job in_progress"), "deadline_exceeded"),  # an error record
        ("RETRY", None, "retry"),
        ("REJECTED", None, "requeued"),
        ("FAILURE", InvalidRequest("x"), "invalid_request"),
        ("FAILURE", DeadlineExceeded("x"), "deadline_exceeded"),
        ("FAILURE", EngineFailure("x"), "engine_error"),
        ("FAILURE", ContextLengthExceeded("x"), "context_length_exceeded"),
        ("FAILURE", EngineCrash("x"), "engine_crash"),  # quarantine's verdict
        ("FAILURE", KeyError("x"), "internal_error"),
    ],
)
def test_outcome_labels(state, retval, outcome):
    assert outcome_of(state, retval) == outcome


def test_quarantine_counter_is_exposed():
    from batchery.contract.settings import Settings
    from batchery.tasks import quarantine
    from batchery.worker import metrics
    from batchery.worker.service import EngineService

    m = metrics.WorkerMetrics(EngineService(None), Settings(broker_url="memory://"), task_names=[CHAT_TASK])
    before = Scrape(m.render())["batchery_quarantined_requests_total"]
    for _ in range(3):
        quarantine._count_quarantined()
    after = Scrape(m.render())
    assert after["batchery_quarantined_requests_total"] == before + 3
    assert after["batchery_requests_total", {"task": CHAT_TASK, "outcome": "success"}] == 0  # exists at 0
    assert after["batchery_engine_state", {"state": "new"}] == 1
    assert "batchery_queue_depth" not in after.families  # memory:// has no depth to report
    assert json.dumps(metrics.METRICS)  # the documented list is plain data
