"""Structured logs: the request context on every line about a request (task id; job id, line and
custom_id for batch lines), text and JSON formats, and passwords masked whatever logged them.

The formatters are exercised inside a real Celery task run (``Task.apply``: Celery's own tracer,
without a broker), and once more in the log of a real worker."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
from celery import Celery

from batchery.worker.logs import configure_logging, log_context, make_handler, mask_secrets

SECRET = "s3cr3t-Pa55"


@pytest.fixture()
def capture():
    """``capture(fmt)`` -> a StringIO receiving the ``batchery.test`` logger through our handler."""
    logger = logging.getLogger("batchery.test")
    handlers = []

    def attach(fmt: str) -> io.StringIO:
        stream = io.StringIO()
        h = make_handler(fmt, stream)
        logger.addHandler(h)
        handlers.append(h)
        return stream

    old = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield attach
    for h in handlers:
        logger.removeHandler(h)
    logger.setLevel(old[0])
    logger.propagate = old[1]


def run_task(name: str, **kwargs) -> str:
    """Run a task through Celery's tracer; it logs one line with a URL and one exception."""
    app = Celery("logs-test", set_as_current=False)
    log = logging.getLogger("batchery.test")

    @app.task(name=name, bind=True)
    def task(self, **kw):
        log.info("connecting to redis://:%s@10.0.0.5:6379/0", SECRET)
        try:
            raise ConnectionError(f"cannot reach rediss://admin:{SECRET}@redis.internal:6380/0")
        except ConnectionError:
            log.exception("request failed")
        return self.request.id

    return task.apply(kwargs=kwargs, task_id="tid-123").get()


def test_json_lines_inside_a_batch_task_carry_job_line_custom_id_and_mask_passwords(capture):
    out = capture("json")
    run_task("batchery.batch_line", job="batch_abc", line=7, custom_id="row 7", url="/v1/chat/completions", body={})
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["task_id"] == "tid-123" and r["task_name"] == "batchery.batch_line"
        assert (r["job_id"], r["line"], r["custom_id"]) == ("batch_abc", 7, "row 7")
        assert r["logger"] == "batchery.test" and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", r["ts"])
    assert records[0]["message"] == "connecting to redis://:***@10.0.0.5:6379/0"
    assert records[1]["level"] == "ERROR" and "ConnectionError" in records[1]["exc_info"]
    assert "rediss://admin:***@redis.internal:6380/0" in records[1]["exc_info"]
    assert SECRET not in out.getvalue()


def test_text_lines_keep_the_prefix_and_append_the_context(capture):
    out = capture("text")
    run_task("batchery.chat_completion", body={})
    first, *rest = out.getvalue().splitlines()
    m = re.match(
        r"(\S+ \S+) INFO \[[^\]]+\] batchery.test: connecting to redis://:\*\*\*@10.0.0.5:6379/0"
        r" \| task_id=tid-123 task_name=batchery.chat_completion$",
        first,
    )
    assert m, first
    assert "job_id" not in first  # a chat request has no job
    assert SECRET not in out.getvalue() and "Traceback" in out.getvalue()


def test_no_context_outside_a_task_unless_bound(capture):
    out = capture("json")
    log = logging.getLogger("batchery.test")
    log.info("engine failure: failing 3 requests")
    with log_context(job_id="batch_x"):
        log.info("submitting")
    log.info("task_id given explicitly", extra={"task_id": "t-9"})
    a, b, c = (json.loads(line) for line in out.getvalue().splitlines())
    assert "task_id" not in a and "job_id" not in a
    assert b["job_id"] == "batch_x"
    assert c["task_id"] == "t-9"


@pytest.mark.parametrize(
    "text, masked",
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:p@ss@h:6380/0?ssl_cert_reqs=required", "rediss://user:***@h:6380/0?ssl_cert_reqs=required"),
        ("amqp://guest:guest@rabbit//", "amqp://guest:***@rabbit//"),
        ("url ?password=abc&x=1 and requirepass hunter2", "url ?password=***&x=1 and requirepass ***"),
        ("redis://127.0.0.1:6379/0 has no password", "redis://127.0.0.1:6379/0 has no password"),
        ("Redis refused the password in BATCHERY_BROKER_URL", "Redis refused the password in BATCHERY_BROKER_URL"),
    ],
)
def test_mask_secrets(text, masked):
    assert mask_secrets(text) == masked


def test_configure_logging_replaces_only_its_own_handler():
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    try:
        configure_logging("debug", "json")
        configure_logging("WARNING", "text")
        ours = [h for h in root.handlers if getattr(h, "batchery_handler", False)]
        assert len(ours) == 1 and foreign in root.handlers and root.level == logging.WARNING
        with pytest.raises(ValueError, match="log format"):
            make_handler("yaml")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.captureWarnings(False)


def test_worker_log_lines_about_requests_carry_their_ids(tiny_worker, tiny_client):
    h = tiny_client.chat([{"role": "user", "content": "hello"}], max_tokens=2)
    h.get(timeout=60)
    line = {
        "custom_id": "log-check 1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    }
    job = tiny_client.submit_batch([line])
    try:
        tiny_client.wait_batch(job, timeout=60)
    finally:
        tiny_client.jobs.delete(job)
    received = tiny_worker.wait_for_log(rf"Task batchery.chat_completion\[{h.id}\] received.*", 10).group(0)
    assert received.endswith(f"| task_id={h.id} task_name=batchery.chat_completion")
    done = tiny_worker.wait_for_log(rf"Task batchery.chat_completion\[{h.id}\] succeeded.*", 10).group(0)
    assert done.endswith(f"| task_id={h.id} task_name=batchery.chat_completion")
    batch = tiny_worker.wait_for_log(rf"Task batchery.batch_line\[{job}-1\] succeeded.*", 10).group(0)
    assert batch.endswith(f'task_name=batchery.batch_line job_id={job} line=1 custom_id="log-check 1"')
