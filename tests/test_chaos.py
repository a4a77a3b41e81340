"""The chaos scenarios of issue 5, fast versions, through real worker processes and Redis (tiny
model): each runs a batch job while something breaks, reads every record back and asserts the
row: lost = 0, duplicated = 0, and failed = exactly the lines meant to fail (with the intended
error code), plus the scenario's own checks. The scenarios and their bookkeeping are those of
``benchmarks/chaos.py`` (with ``--fast`` sizes), so the benchmark's table and these tests cannot
drift apart. Waits are on conditions (job status, log lines, /stats) with timeouts."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, TEST_BROKER_URL, redis_client

sys.path.insert(0, str(REPO / "benchmarks"))

import chaos  # noqa: E402  (benchmarks/chaos.py)

pytestmark = pytest.mark.integration  # real worker processes and private Redis servers


@pytest.fixture(scope="module")
def harness(tiny_model_dir, redis_urls, tmp_path_factory):
    h = chaos.Chaos(
        str(tiny_model_dir), TEST_BROKER_URL, tmp_path_factory.mktemp("chaos"), chaos.Sizes.fast(), verbose=False
    )
    yield h
    h.close()


def check(row: chaos.Row, harness) -> None:
    print("\n" + chaos.table([row]))
    logs = "\n".join(f"--- {w.log_path.name}\n{w.tail(30)}" for w in harness.workers[-2:])
    assert row.lost == 0, logs
    assert row.duplicated == 0, f"{row.notes}\n{logs}"
    assert not row.unexpected, f"lines whose outcome was not the intended one: {row.unexpected[:10]}\n{logs}"
    assert row.failed == row.expected_failed
    assert all(row.checks.values()), f"{row.checks}\n{logs}"
    assert row.ok


def test_1_engine_step_raises_periodically(harness):
    row = harness.engine_raise()
    check(row, harness)
    assert row.completed == row.requests
    assert int(row.notes.split()[0]) >= 2  # several engine failures along the job


def test_2_hung_step_watchdog(harness):
    check(harness.hang(), harness)


def test_3_worker_sigkilled_and_restarted(harness):
    row = harness.kill_restart()
    check(row, harness)
    assert row.recovery_s is not None  # every line the dead worker held was finished by the new one


def test_4_two_workers_one_sigkilled(harness):
    row = harness.kill_one_of_two()
    check(row, harness)
    assert row.recovery_s is not None


def test_5_redis_restart_with_aof(harness):
    check(harness.redis_restart(), harness)


def test_6_poison_lines_fail_alone(harness):
    row = harness.poison()
    check(row, harness)
    assert row.failed == harness.sizes.poison_bad and row.completed == harness.sizes.poison_good


def test_7_out_of_memory_shrinks_steps(harness):
    check(harness.oom(), harness)


def test_8_deadlines_under_load_free_the_kv_pool(harness):
    row = harness.deadlines()
    check(row, harness)
    assert row.completed == 0 and row.failed == row.requests


def test_9_parameters_the_model_cannot_take_fail_alone(harness):
    row = harness.invalid_for_model()
    check(row, harness)
    assert row.failed > 0 and row.completed == row.requests - row.failed


def test_10_rss_stays_flat_over_20_rebuilds(harness):
    check(harness.rebuild_rss(), harness)


def test_12_a_client_clock_ahead_does_not_fail_a_live_submission(harness):
    check(harness.clock_ahead(), harness)


def test_17_poison_lines_among_good_lines_with_10_s_deadlines(harness):
    row = harness.poison_deadlines()
    check(row, harness)
    assert row.completed == harness.sizes.poison_good  # no good line ran out of time in quarantine


# row 11 (a job that outlives its 60 s TTL) is the benchmark's only: tests/test_job_store_reliability.py
# keeps the same promise with a short TTL; row 13 (`batchery run`'s worker killed) is
# tests/test_run_reliability.py's.


def test_nothing_left_behind(harness):
    """The scenarios' queues, jobs and unacknowledged messages are gone after cleanup."""
    harness.cleanup()
    r = redis_client(TEST_BROKER_URL)
    for _, queue in harness.namespaces:
        assert not list(r.scan_iter(match=f"{queue}*"))


# -- bounded input: hostile messages --------------------------------------------------------------
def _raw_message(app, task: str, queue: str, task_id: str, body_json: str) -> str:
    """A Celery message for ``task`` whose body is ``body_json`` exactly as given (so it can be
    something no well-behaved client would send)."""
    import base64
    import json

    from batchery.broker.publish import MessageBuilder

    msg = json.loads(MessageBuilder(app, task, queue).build(task_id, {}))
    msg["body"] = base64.b64encode(body_json.encode()).decode()
    return json.dumps(msg)


def test_hostile_messages_do_not_take_the_worker_down(tiny_worker, tiny_client):
    import uuid

    from conftest import wait_for

    from batchery.contract.names import BATCH_LINE_TASK, CHAT_TASK

    app, q, store = tiny_client.app, tiny_worker.queue, tiny_client.jobs
    job = f"batch_hostile{uuid.uuid4().hex[:8]}"
    store.create(job, queue=q, model=None)
    store.r.hset(store.key(job), "total", 1)
    store.end_submit(job, 1, 1)
    ok_body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    line = '"custom_id": "x", "url": "/v1/chat/completions", "body": ' + ok_body
    tagged = {  # each fails on its own, with a log line naming its task id
        "body-is-a-list": (CHAT_TASK, '[[], {"body": [1, 2, 3]}, {}]'),
        "huge-timeout": (CHAT_TASK, f'[[], {{"body": {ok_body}, "timeout": 1e308}}, {{}}]'),
        "string-priority": (BATCH_LINE_TASK, f'[[], {{"job": "{job}", "line": 1, {line}, "priority": "first"}}, {{}}]'),
        "line-not-a-number": (BATCH_LINE_TASK, f'[[], {{"job": "{job}", "line": "one", {line}}}, {{}}]'),
    }
    undecodable = {  # refused before any task runs
        "nested": (CHAT_TASK, '[[], {"body": ' + "[" * 50_000 + "]" * 50_000 + "}, {}]"),
        "not-json": (CHAT_TASK, "{this is not json"),
    }
    ids = {name: f"hostile-{name}-{uuid.uuid4().hex[:6]}" for name in {**tagged, **undecodable}}
    refused = r"(?i)can't decode message body"
    n_refused = tiny_worker.count(refused)
    r = redis_client(TEST_BROKER_URL)
    r.lpush(
        q, *[_raw_message(app, task, q, ids[name], body) for name, (task, body) in {**tagged, **undecodable}.items()]
    )
    for name in tagged:
        tiny_worker.wait_for_log(rf"\[{ids[name]}\] (raised|succeeded)", 30)
    wait_for(lambda: tiny_worker.count(refused) >= n_refused + 2, 30, what="two undecodable bodies refused")
    wait_for(lambda: r.llen(q) == 0, 30, what="every hostile message consumed")
    # the string priority is refused before the line touches its job (tasks/messages.py): no record, and
    # the message is on the dead-letter list, saying why
    from batchery.jobs.deadletter import DeadLetters

    assert store.r.hget(store.keys(job)[1], "1") is None
    entry = DeadLetters(store.r, tiny_client.settings.deadletter.key_prefix).get(ids["string-priority"])
    assert entry["reason"] == "invalid_message" and "priority" in entry["message"]
    status, health = tiny_worker.http("/healthz")
    assert status == 200 and health["state"] == "serving"
    assert tiny_worker.stats()["num_failures"] == 0  # none of it made an engine step fail
    assert (
        tiny_client.chat([{"role": "user", "content": "hello"}], max_tokens=3).get(timeout=60).usage.completion_tokens
        == 3
    )
    store.delete(job)


def test_poison_chat_request_reaches_the_client_as_engine_crash(workers):
    """The same quarantine for single chat tasks: the poison one raises ``EngineCrash`` (not
    retried further), the others complete, the worker stays up."""
    from batchery.contract.errors import EngineCrash

    w = workers.spawn(BATCHERY_FAULTS=f"poison:{chaos.POISON}")
    client = workers.client(w.queue)
    poison = client.chat([{"role": "user", "content": f"the cat {chaos.POISON} sat"}], max_tokens=4)
    others = client.chat_many(
        [[{"role": "user", "content": f"hello {i}"}] for i in range(6)], max_tokens=4, ignore_eos=True
    )
    with pytest.raises(EngineCrash, match=r"ran alone.*InjectedFault"):
        poison.get(timeout=120)
    assert all(h.get(timeout=120).usage.completion_tokens == 4 for h in others)
    assert w.count(rf"\[{poison.id}\] retry") == 2  # two strikes, then the solo runs in one attempt
    assert w.stats()["num_poisoned"] == 1 and w.http("/healthz")[0] == 200
    client.close()
