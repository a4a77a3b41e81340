"""Failures outside an engine step, in-process on the real tiny model (issue 13, item 7): work the
loop thread does between steps (tokenizing an inbox, adding requests, building results) shows
progress to the watchdog; a request whose own work outside a step fails gets a clear error at once
and fails alone; a failure outside any step and any request strikes nobody (everyone is carried
over), and a run of them with no successful step in between makes the service give up rather than
rebuild for ever."""

from __future__ import annotations

import logging
import time

import pytest
from conftest import wait_for

from batchery.contract.errors import EngineFailure, EngineUnavailable
from batchery.engine.config import EngineConfig
from batchery.worker.service import EngineService, GenerationRequest
from batchery.worker.service.faults import LoopRaise, ResultRaise, TokenizeDelay, parse_faults

POISON = "XYZZY"


@pytest.fixture()
def make_service(tiny_model_dir):
    services = []

    def make(faults: str = "", **kwargs) -> EngineService:
        config = EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_num_seqs=64,
            num_kv_blocks=1024,
            max_model_len=4096,
            max_num_batched_tokens=1024,
        )
        s = EngineService(config, faults=parse_faults(faults), rebuild_backoff=0.05, **kwargs)
        s.start()
        services.append(s)
        return s

    yield make
    for s in services:
        s.stop()


def chat(text: str, **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": text}],
        sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling},
    )


def outcomes(futures, timeout: float = 60.0) -> list:
    out = []
    for f in futures:
        try:
            out.append(f.result(timeout=timeout))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)
    return out


def test_the_new_fault_kinds_parse():
    delay, result, loop, again = parse_faults(
        f"tokenize_delay:0.5, result_raise:{POISON}:x ,loop_raise:2,loop_raise:1:3"
    )
    assert isinstance(delay, TokenizeDelay) and delay.seconds == 0.5
    assert isinstance(result, ResultRaise) and result.text == f"{POISON}:x"  # free text, colons kept
    assert isinstance(loop, LoopRaise) and (loop.at, loop.count) == (2, 1) and (again.at, again.count) == (1, 3)
    for bad in ("tokenize_delay:x", "result_raise:", "loop_raise:0", "loop_raise:1:2:3"):
        with pytest.raises(ValueError, match="fault"):
            parse_faults(bad)


def test_a_failure_building_a_result_fails_that_request_alone_at_once(make_service):
    """The request's future gets a clear error well before any deadline (before: it was popped from
    the pending set and the loop died, so nothing ever resolved it, and the failure, outside a step,
    struck every request in the engine)."""
    s = make_service(f"result_raise:{POISON}")
    _, bad = s.submit(chat(f"the cat {POISON} sat"))
    good = [s.submit(chat(f"hello {i}"))[1] for i in range(6)]
    t0 = time.monotonic()
    with pytest.raises(EngineFailure, match=r"building its result.*InjectedFault.*result_raise") as info:
        bad.result(timeout=20)
    assert time.monotonic() - t0 < 10 and not info.value.struck  # a retry, not a strike
    results = outcomes(good)
    assert all(not isinstance(r, Exception) and len(r.token_ids) == 8 for r in results), results
    assert (s.num_failures, s.num_struck, s.num_rebuilds) == (0, 0, 0)  # the engine never failed
    assert len(s.generate(chat("the engine goes on"), timeout=30).token_ids) == 8


def test_slow_tokenization_of_a_big_inbox_does_not_fire_the_watchdog(make_service):
    """24 requests arrive together and each takes 0.15 s to tokenize: 3.6 s of loop-thread work
    outside any step, against a 1 s watchdog. Each request tokenized is progress (before: the
    watchdog fired and struck what was in the engine)."""
    s = make_service("tokenize_delay:0.15", watchdog_timeout=1.0, batch_wait=0.5)
    futures = [s.submit(chat(f"hello {i}"))[1] for i in range(24)]
    results = outcomes(futures)
    assert all(not isinstance(r, Exception) and len(r.token_ids) == 8 for r in results), results
    assert (s.num_failures, s.num_struck) == (0, 0)


def test_a_failure_outside_any_step_strikes_nobody(make_service, caplog):
    """The loop raises while it takes new work (outside any step and any request's own work) with a
    request running in the engine: everyone is carried over and completes, nobody is struck (before:
    everything in the engine was struck)."""
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service("loop_raise:2")  # the second time the loop takes new work
    _, running = s.submit(chat("hello world", max_tokens=400))
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="the first request to run")
    later = [s.submit(chat(f"the dog {i}"))[1] for i in range(3)]
    results = outcomes([running, *later])
    assert all(not isinstance(r, Exception) for r in results), results
    assert len(results[0].token_ids) == 400 and all(len(r.token_ids) == 8 for r in results[1:])
    assert (s.num_failures, s.num_struck) == (1, 0)
    assert s.num_carried_over >= 2  # the running request and what had arrived (the rest may come after)
    assert any("failing 0 in-flight requests" in r.getMessage() for r in caplog.records)


def test_failures_outside_any_step_in_a_row_make_the_service_give_up(make_service):
    """Every engine fails outside a step, before any step succeeds: nobody is struck, and after
    ``max_rebuilds`` such failures in a row the service gives up (its work goes back to the queue
    untouched) instead of rebuilding for ever (before: it rebuilt for ever and the futures waited)."""
    reasons: list[str] = []
    s = make_service("loop_raise:1:1000", max_rebuilds=2, on_fatal=reasons.append)
    futures = [s.submit(chat(f"hello {i}"))[1] for i in range(3)]
    results = outcomes(futures, timeout=30)
    assert all(isinstance(r, EngineUnavailable) for r in results), results
    assert "outside any engine step" in reasons[0] and s.fatal and s.num_struck == 0
