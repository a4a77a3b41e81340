"""Reliability in-process, on the real tiny model: fault injection (poison, oom, step_raise_every),
who pays for an engine failure (only the requests in the failing step; the rest are carried over),
quarantine (a request run alone: innocent or poison), the canary after a rebuild, out of memory
shrinking the step, and the bounds on hostile input. The same through Redis and worker processes,
scenario by scenario, is in test_chaos.py."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from conftest import wait_for

from batchery.contract.errors import EngineCrash, EngineFailure, InvalidRequest
from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import OOM_MIN_TOKENS, LLMEngine
from batchery.engine.sampling import SamplingParams
from batchery.worker.service import EngineService, GenerationRequest
from batchery.worker.service.faults import OutOfMemory, Poison, StepRaiseEvery, parse_faults

POISON = "XYZZY"


def config(tiny_model_dir, **kw) -> EngineConfig:
    base = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        max_num_seqs=64,
        num_kv_blocks=1024,
        max_model_len=2048,
        max_num_batched_tokens=1024,
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture()
def make_service(tiny_model_dir):
    services = []

    def make(faults: str = "", *, cfg: dict | None = None, **kwargs) -> EngineService:
        s = EngineService(
            config(tiny_model_dir, **(cfg or {})), faults=parse_faults(faults), rebuild_backoff=0.05, **kwargs
        )
        s.start()
        services.append(s)
        return s

    yield make
    for s in services:
        s.stop()


def chat(text: str, *, solo: bool = False, **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": text}],
        solo=solo,
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


# -- the fault parser -----------------------------------------------------------------------------
def test_new_fault_kinds_parse_and_refuse_bad_specs():
    poison, oom, every = parse_faults("poison:a b:c, oom:3 ,step_raise_every:40")
    assert isinstance(poison, Poison) and poison.text == "a b:c"  # free text, colons kept
    assert isinstance(oom, OutOfMemory) and oom.at_step == 3
    assert isinstance(every, StepRaiseEvery) and every.every == 40
    for bad, needle in [
        ("poison:", "non-empty TEXT"),
        ("oom:0", ">= 1"),
        ("oom:x", "integer"),
        ("step_raise_every:", "integer"),
        ("oom:1:2", "expected oom:N"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_faults(bad)


# -- out of memory in the engine ------------------------------------------------------------------
def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {}
    for _ in range(10_000):
        for o in engine.step():
            out[o.request_id] = o.token_ids
        if not engine.has_unfinished():
            return out
    raise AssertionError("the engine did not finish")


def test_oom_shrinks_the_step_and_changes_no_output(tiny_model_dir):
    """Greedy outputs with three OOMs on the way equal those without: an OOM step commits
    nothing, the step limits halve, the newest running sequences are preempted and recomputed."""
    cfg = config(tiny_model_dir, max_num_seqs=16, max_num_batched_tokens=256)
    prompts = [[5 + (i * 7 + j) % 50 for j in range(6 + i % 11)] for i in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    clean = generate(LLMEngine(cfg), prompts, params)

    engine = LLMEngine(cfg)
    calls, limits = [0], []

    def hook(seqs):
        calls[0] += 1
        if calls[0] in (2, 3, 9):
            limits.append((len(seqs), engine.scheduler.max_num_seqs))
            raise torch.OutOfMemoryError(f"injected at call {calls[0]}")

    engine.on_step_start = hook
    shrunk = generate(engine, prompts, params)
    assert shrunk == clean
    assert engine.num_oom == 3 and engine.scheduler.num_preemptions > 0
    assert limits[0] == (16, 16) and limits[1][1] == 8  # the second OOM met the halved limit
    st = engine.stats()
    assert st["max_num_seqs"] < 16 and st["kv_blocks_free"] == st["kv_blocks_total"]


def test_oom_that_cannot_shrink_further_raises(tiny_model_dir):
    engine = LLMEngine(config(tiny_model_dir))

    def hook(seqs):
        raise torch.OutOfMemoryError("always")

    engine.on_step_start = hook
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=2))
    assert 3 <= OOM_MIN_TOKENS
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()  # one sequence of three tokens: nothing left to shrink


def test_oom_fault_is_survived_without_an_engine_failure(make_service, caplog):
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service("oom:2,oom:3")
    futures = [s.submit(chat(f"hello world {i}"))[1] for i in range(24)]
    results = outcomes(futures)
    assert all(not isinstance(r, Exception) and len(r.token_ids) == 8 for r in results), results
    assert s.num_failures == 0 and s.engine_stats["num_oom"] == 2
    assert sum("out of memory in a step" in r.getMessage() for r in caplog.records) == 2


# -- who pays for a failure -----------------------------------------------------------------------
def test_only_requests_in_the_failing_step_fail_the_rest_carry_over(make_service, caplog):
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service("step_raise:3", cfg={"max_num_seqs": 4})  # 4 run, 8 wait in the engine
    futures = [s.submit(chat(f"hello {i}", max_tokens=16))[1] for i in range(12)]
    results = outcomes(futures)
    failed = [r for r in results if isinstance(r, Exception)]
    assert len(failed) == 4 and all(isinstance(e, EngineFailure) and e.struck for e in failed)
    assert all(len(r.token_ids) == 16 for r in results if not isinstance(r, Exception))
    assert s.num_struck == 4 and s.num_carried_over == 8
    assert any(
        "failing 4 in-flight requests" in r.getMessage() and "carrying 8 others over" in r.getMessage()
        for r in caplog.records
    )
    assert any("passed its canary step" in r.getMessage() for r in caplog.records)


# -- quarantine -----------------------------------------------------------------------------------
def test_poison_run_alone_fails_for_good_and_held_work_is_untouched(make_service, caplog):
    caplog.set_level(logging.INFO, logger="batchery")
    s = make_service(f"poison:{POISON}", max_rebuilds=1)  # its failures must not make the service give up
    rid, poison = s.submit(chat(f"the cat {POISON} sat", solo=True))
    others = [s.submit(chat(f"hello {i}"))[1] for i in range(10)]  # held while the poison runs alone
    with pytest.raises(EngineCrash, match=rf"each of the 2 times it ran alone.*InjectedFault.*poison:{POISON}"):
        poison.result(timeout=60)
    results = outcomes(others)
    assert all(not isinstance(r, Exception) and len(r.token_ids) == 8 for r in results), results
    assert (s.num_failures, s.num_solo_runs, s.num_poisoned, s.num_struck) == (2, 2, 1, 0)
    assert s.state == "serving" and not s.fatal
    assert any(f"quarantine: request {rid} failed alone 2 times" in r.getMessage() for r in caplog.records)


def test_a_solo_run_hit_by_a_flaky_step_is_run_again_and_completes(make_service):
    s = make_service("step_raise:3")  # the third step of the process fails, whoever is in it
    r = s.generate(chat("hello world", solo=True, max_tokens=6), timeout=60)
    assert len(r.token_ids) == 6
    assert (s.num_failures, s.num_solo_runs, s.num_poisoned) == (1, 2, 0)


def test_solo_runs_take_turns_beside_normal_work(make_service):
    s = make_service()
    done: list[str] = []
    lock = threading.Lock()

    def track(name, fut):
        fut.add_done_callback(lambda f: (lock.acquire(), done.append(name), lock.release()))

    # long enough that the 50 ms polls below see it running even on a loaded machine (with 40
    # tokens it could finish between two looks, and the wait timed out)
    track("normal-0", s.submit(chat("hello", max_tokens=400))[1])
    wait_for(lambda: s.engine_stats.get("num_running"), 60, what="the first request to run")
    track("solo-a", s.submit(chat("the cat", solo=True, max_tokens=4))[1])
    track("normal-1", s.submit(chat("the dog", max_tokens=4))[1])  # not held: goes straight in
    track("solo-b", s.submit(chat("the sea", solo=True, max_tokens=4))[1])
    wait_for(lambda: len(done) == 4, 60, what="all four requests")
    # no drain: the solo runs go in beside normal-0, one at a time, each in steps of its own
    assert done[-1] == "normal-0" and done.index("solo-a") < done.index("solo-b")
    assert s.num_solo_runs == 2


# -- bounded input --------------------------------------------------------------------------------
def test_hostile_request_fields_are_refused_without_hurting_the_engine(make_service):
    s = make_service()
    bad = [
        GenerationRequest(prompt="hello", priority="first"),  # a string priority
        GenerationRequest(prompt="hello", sampling={"max_tokens": -5}),
        GenerationRequest(prompt="hello", sampling={"temperature": float("nan")}),
        GenerationRequest(prompt_token_ids=[10**9]),
        GenerationRequest(prompt_token_ids=[5] * 3000),  # over max_model_len
    ]
    for req in bad:
        with pytest.raises(InvalidRequest):
            s.generate(req, timeout=30)
    assert s.num_failures == 0
    assert len(s.generate(chat("hello"), timeout=30).token_ids) == 8
    wait_for(lambda: s.engine_stats["kv_blocks_free"] == s.engine_stats["kv_blocks_total"], 10, what="an idle pool")


def test_schema_caps_prompt_and_max_tokens():
    from batchery.contract.schemas import MAX_TEXT_CHARS, MAX_TOKENS_LIMIT, ChatCompletionRequest, CompletionRequest

    with pytest.raises(ValueError, match="max_tokens"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": MAX_TOKENS_LIMIT + 1}
        )
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": "x" * (MAX_TEXT_CHARS + 1)})
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x" * 600_000}] * 2})


# -- messages the broker lost ---------------------------------------------------------------------
def test_lines_whose_messages_were_lost_are_found_and_queued_again(redis_urls):
    """kombu pops a message (BRPOP) before recording it as unacknowledged; a Redis restart or a
    worker death in between loses it. The job's ledger finds such lines: pending, not queued, not
    held by a worker, not leased. Here line 1 is lost, line 2 is held unacknowledged by a worker,
    line 3 is leased (running): only line 1 is queued again, with a fresh delivery tag."""
    import uuid

    from conftest import TEST_BROKER_URL, TEST_RESULT_BACKEND, drop_queue_keys, redis_client

    from batchery.client import Client
    from batchery.contract.settings import Settings
    from batchery.jobs.recover import find_lost

    queue = f"batchery-test-{uuid.uuid4().hex[:10]}"
    c = Client(
        settings=Settings(
            broker_url=TEST_BROKER_URL,
            result_backend=TEST_RESULT_BACKEND,
            queue=queue,
            batch={"key_prefix": f"{queue}:batch", "ttl": 600, "chunk_lines": 1},  # a message a line: lost one by one
        )
    )
    broker = redis_client(TEST_BROKER_URL)
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        }
        for i in range(1, 4)
    ]
    tag = None
    try:
        job = c.submit_batch(lines)
        assert c.jobs.pending_lines(job) == {1, 2, 3}
        assert find_lost(c.jobs, broker, job, queue, confirm_s=0) == set()  # all still queued
        popped = {json.loads(m)["headers"]["id"]: m for m in (broker.rpop(queue) for _ in range(3))}
        assert not broker.llen(queue)
        held = json.loads(popped[f"{job}-2"])
        tag = held["properties"]["delivery_tag"]
        broker.hset("unacked", tag, json.dumps([held, "", queue]))  # a worker holds line 2
        assert c.jobs.claim(job, 3, 60) == "run"  # a worker runs line 3
        assert find_lost(c.jobs, broker, job, queue, confirm_s=0) == {1}
        assert c.requeue_lost(job) == 1
        again = json.loads(broker.rpop(queue))
        assert again["headers"]["id"] == f"{job}-1"
        assert again["properties"]["delivery_tag"] != json.loads(popped[f"{job}-1"])["properties"]["delivery_tag"]
        assert again["body"] == json.loads(popped[f"{job}-1"])["body"]
        # once recorded, a line leaves the ledger; a finished job drops it whole
        c.jobs.write(job, 1, {"id": "x", "custom_id": "c1", "response": None, "error": None}, False)
        assert c.jobs.pending_lines(job) == {2, 3}
        c.jobs.cancel(job)
        c.jobs.write(job, 3, {"id": "y", "custom_id": "c3", "response": None, "error": None}, False)
        assert c.jobs.get_status(job) == "cancelled" and not c.jobs.r.exists(c.jobs.keys(job)[3])
        assert c.requeue_lost(job) == 0  # not in progress: nothing to look for
    finally:
        if tag:
            broker.hdel("unacked", tag)
        for r in (broker, redis_client(TEST_RESULT_BACKEND)):
            drop_queue_keys(r, queue)
        c.close()


def test_an_engine_that_fails_all_real_work_is_given_up_not_blamed_on_requests(make_service):
    """Its canary passes, but every work step fails: requests run alone fail one after the other.
    After a few such verdicts with no successful step in between, the service gives up (the
    worker exits non-zero and the rest of the work goes back to the queue) instead of calling
    every request poison."""
    from batchery.contract.errors import EngineUnavailable
    from batchery.worker.service.triage import POISON_BREAKER

    reasons = []
    s = make_service("step_raise_every:1", on_fatal=reasons.append)
    futures = [s.submit(chat(f"hello {i}", solo=True))[1] for i in range(POISON_BREAKER + 3)]
    results = outcomes(futures)
    wait_for(lambda: reasons, 30, what="on_fatal")
    assert "looks broken" in reasons[0] and s.fatal
    assert sum(isinstance(r, EngineCrash) for r in results) == POISON_BREAKER
    assert all(isinstance(r, EngineUnavailable) for r in results[POISON_BREAKER:])
