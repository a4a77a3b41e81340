"""The engine service in-process, on the real tiny model: futures, deadlines, the supervisor,
the watchdog and giving up. (The same behaviour through Redis and a worker process is in
test_worker.py; here the timing is tight and failures are easy to read.)"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from conftest import wait_for

from batchery.contract.errors import (
    DeadlineExceeded,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    WorkerShuttingDown,
)
from batchery.engine.config import EngineConfig
from batchery.worker.service import EngineService, GenerationRequest
from batchery.worker.service.faults import parse_faults

LONG = dict(max_tokens=6000, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def make_service(tiny_model_dir):
    services = []

    def make(faults: str = "", **kwargs) -> EngineService:
        config = EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_num_seqs=64,
            num_kv_blocks=1024,
            max_model_len=8192,
            max_num_batched_tokens=1024,
        )
        s = EngineService(config, faults=parse_faults(faults), rebuild_backoff=0.05, **kwargs)
        s.start()
        services.append(s)
        return s

    yield make
    for s in services:
        s.stop()


def chat(text: str = "hello world", **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": text}], sampling={"max_tokens": 8, "temperature": 0.0, **sampling}
    )


def kv_all_free(s: EngineService) -> bool:
    e = s.engine_stats
    return e["kv_blocks_free"] == e["kv_blocks_total"] and e["num_running"] == 0 and e["num_waiting"] == 0


def test_generate_chat_prompt_and_token_ids(make_service):
    s = make_service()
    a = s.generate(chat(), timeout=30)
    b = s.generate(chat(), timeout=30)
    assert a.finish_reason in ("stop", "length") and a.text == b.text and a.token_ids == b.token_ids  # greedy
    assert a.num_prompt_tokens > 0 and 0 < len(a.token_ids) <= 8
    p = s.generate(GenerationRequest(prompt="once upon a time", sampling={"max_tokens": 4, "ignore_eos": True}), 30)
    assert len(p.token_ids) == 4 and p.finish_reason == "length"
    t = s.generate(
        GenerationRequest(prompt_token_ids=[7, 8, 9], sampling={"max_tokens": 3, "ignore_eos": True, "logprobs": 2}), 30
    )
    assert len(t.logprobs) == 3 and all(len(e["top"]) == 2 and isinstance(e["token"], str) for e in t.logprobs)
    assert t.submitted_at <= t.added_at <= t.finished_at


def test_max_tokens_none_fills_the_context(make_service):
    s = make_service()
    r = s.generate(
        GenerationRequest(prompt_token_ids=[5] * 8000, sampling={"max_tokens": None, "ignore_eos": True}), timeout=60
    )
    assert r.finish_reason == "length" and r.num_prompt_tokens + len(r.token_ids) == 8192


def test_bad_prompts_fail_alone_and_the_engine_goes_on(make_service):
    s = make_service()
    with pytest.raises(InvalidRequest, match="max_model_len"):
        s.generate(GenerationRequest(prompt_token_ids=[5] * 9000, sampling={"max_tokens": 1}), 30)
    with pytest.raises(InvalidRequest, match="empty"):
        s.generate(GenerationRequest(prompt_token_ids=[], sampling={"max_tokens": 1}), 30)
    with pytest.raises(InvalidRequest, match="temperature"):
        s.generate(chat(temperature=-1.0), 30)
    assert s.generate(chat(), 30).token_ids
    assert s.num_failures == 0


def test_concurrent_requests_share_batches(make_service):
    s = make_service()
    results, errors = [], []

    def run(i):
        try:
            results.append(s.generate(chat("hello " * (i + 1), max_tokens=32, ignore_eos=True), 60))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 32
    assert all(len(r.token_ids) == 32 for r in results)
    assert s.stats()["mean_batch_size"] > 8


def test_deadline_aborts_and_frees_kv_blocks(make_service):
    s = make_service()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="deadline of 0.5 s exceeded"):
        s.generate(chat(**LONG), timeout=0.5)
    assert time.monotonic() - t0 < 1.0
    wait_for(lambda: kv_all_free(s), 5, what="KV blocks to return to the pool")
    assert s.num_aborted == 1


def test_step_exception_fails_in_flight_requests_and_rebuilds(make_service, caplog):
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service("step_raise:5")
    loaded = s._loaded
    futures = [s.submit(chat(f"hello {i}", **LONG))[1] for i in range(8)]
    for f in futures:
        with pytest.raises(EngineFailure, match="retried"):
            f.result(timeout=30)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "InjectedFault" in errors[0].getMessage() and "Traceback" in errors[0].getMessage()
    assert "failing 8 in-flight requests" in errors[0].getMessage()
    wait_for(lambda: s.state == "serving" and s.num_rebuilds == 1, 10, what="the rebuild")
    assert s._loaded is loaded  # weights reused
    assert any("engine restarted" in r.getMessage() for r in caplog.records)
    assert s.generate(chat(), 30).token_ids  # serving again, on a fresh engine
    assert kv_all_free(s)


def test_watchdog_abandons_a_hung_step(make_service, caplog):
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service("step_hang:3:60", watchdog_timeout=0.5)
    old_loop = s._loop_thread
    _, fut = s.submit(chat(**LONG))
    t0 = time.monotonic()
    with pytest.raises(EngineFailure, match="watchdog"):
        fut.result(timeout=10)
    assert time.monotonic() - t0 < 0.5 + 1.5
    wait_for(lambda: not old_loop.is_alive(), 5, what="the hung loop thread to unwind")
    wait_for(lambda: s.state == "serving", 10, what="the rebuild")
    assert s.generate(chat(), 30).token_ids
    assert s.health()["healthy"]


def test_gives_up_after_k_failed_rebuilds(make_service, caplog):
    reasons = []
    s = make_service("step_raise:2,rebuild_raise:9", max_rebuilds=2, on_fatal=reasons.append)
    _, fut = s.submit(chat(**LONG))
    with pytest.raises(EngineFailure):
        fut.result(timeout=30)
    wait_for(lambda: reasons, 10, what="on_fatal")
    assert s.fatal and "2 consecutive engine rebuilds failed" in reasons[0]
    assert not s.health()["healthy"] and not s.ready
    with pytest.raises(EngineUnavailable):
        s.submit(chat())


def test_drain_returns_unfinished_work(make_service):
    s = make_service()
    _, fut = s.submit(chat(**LONG))
    wait_for(lambda: s.engine_stats.get("num_running"), 10, what="the request to run")
    s.begin_drain(0.1)
    with pytest.raises(WorkerShuttingDown):
        s.submit(chat())
    with pytest.raises(WorkerShuttingDown):
        fut.result(timeout=10)
    wait_for(lambda: kv_all_free(s), 5, what="KV blocks to return to the pool")
