"""A batch job's usage counts the prompt tokens its lines got from the prefix cache (each output record's
``usage.prompt_tokens_details.cached_tokens``, or a Response's ``input_tokens_details``), once per line, and
``batchery run`` shows them: "711 prompt (312 from the prefix cache) + 705 completion". Real Redis (a per-test key
prefix); one test runs the tiny model's worker."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from conftest import TEST_RESULT_BACKEND, redis_client

from batchery.contract.batch import output_record
from batchery.jobs.store import JobStore
from batchery.run import cached_tokens, print_summary, summary


@pytest.fixture()
def store(redis_urls):
    prefix = f"batchery-test-{uuid.uuid4().hex[:10]}"
    yield JobStore(redis_client(TEST_RESULT_BACKEND), prefix, ttl=600)
    r = redis_client(TEST_RESULT_BACKEND)
    keys = list(r.scan_iter(match=f"{prefix}:*"))
    if keys:
        r.delete(*keys)


def new_job(store: JobStore, total: int) -> str:
    job = f"batch_{uuid.uuid4().hex}"
    store.create(job, queue="q", model="m")
    store.r.hset(store.key(job), "total", total)
    assert store.end_submit(job, total, total) == "in_progress"
    return job


def record(job: str, line: int) -> dict:
    return output_record(job, line, f"c{line}", f"t{line}", {"object": "chat.completion"})


def test_the_job_sums_its_lines_cached_tokens_once_each(store):
    job = new_job(store, 3)
    assert cached_tokens(store.status(job).usage) == 0
    assert store.write(job, 1, record(job, 1), False, 300, 5, 0) == (True, "in_progress")
    assert store.write(job, 2, record(job, 2), False, 311, 5, 296)[0]
    assert store.write(job, 2, record(job, 2), False, 311, 5, 296) == (False, "in_progress")  # a redelivery
    assert store.write(job, 3, record(job, 3), False, 100, 4, 16) == (True, "completed")
    usage = store.status(job).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (711, 14, 725)
    assert usage.model_dump()["prompt_tokens_details"] == {"cached_tokens": 312}
    assert cached_tokens(usage) == 312


def test_the_run_summary_shows_them(store):
    job = new_job(store, 2)
    store.write(job, 1, record(job, 1), False, 400, 400, 0)
    store.write(job, 2, record(job, 2), False, 311, 305, 312)
    s = summary(store.status(job), 3.0, 2, 0)
    assert (s["prompt_tokens"], s["cached_tokens"], s["completion_tokens"]) == (711, 312, 705)
    json.dumps(s)  # the --json summary
    out = io.StringIO()
    print_summary(s, "out.jsonl", None, out)
    assert "tokens: 711 prompt (312 from the prefix cache) + 705 completion;" in out.getvalue()


@pytest.mark.integration
def test_a_job_on_the_tiny_model_counts_what_the_prefix_cache_served(tiny_client, tmp_path):
    doc = " ".join(f"w{i % 50}" for i in range(120))
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"question {i}"}],
                "max_tokens": 3,
            },
        }
        for i in range(4)
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = tiny_client.wait_batch(tiny_client.submit_batch(path), timeout=180)
    assert job.status == "completed", job
    records = list(tiny_client.batch_results(job.id))
    per_line = [r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records]
    assert sum(per_line) > 0  # the document was computed once, the other lines hit it
    assert cached_tokens(job.usage) == sum(per_line)
    assert job.usage.prompt_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in records)
