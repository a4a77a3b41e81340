"""Quarantine makes no innocent request pay (issue 13, item 8), in-process on the real tiny model: a
quarantined request runs alone in steps of its own while the other work goes on in the steps in
between, so nobody is held (and nobody's deadline runs out waiting), a failing isolated step names
the suspect only, and a failing shared step never counts against the suspect. Also: an
out-of-memory error in an isolated step shrinks the token budget, not the batch of the others."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import wait_for

from batchery.contract.errors import EngineCrash
from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.sampling import SamplingParams
from batchery.worker.service import EngineService, GenerationRequest
from batchery.worker.service.faults import parse_faults

POISON = "XYZZY"


def config(tiny_model_dir, **kw) -> EngineConfig:
    base = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        max_num_seqs=64,
        num_kv_blocks=1024,
        max_model_len=8192,
        max_num_batched_tokens=1024,
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture()
def make_service(tiny_model_dir):
    services = []

    def make(faults: str = "", **kwargs) -> EngineService:
        s = EngineService(config(tiny_model_dir), faults=parse_faults(faults), rebuild_backoff=0.05, **kwargs)
        s.start()
        services.append(s)
        return s

    yield make
    for s in services:
        s.stop()


def chat(text: str, *, solo: bool = False, exclusive: bool = False, **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": text}],
        solo=solo,
        exclusive=exclusive,
        sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling},
    )


def generate_all(s: EngineService, requests: list[GenerationRequest], timeout: float) -> list:
    """``generate`` each request on its own thread (as the task threads do), with its deadline."""

    def one(req):
        try:
            return s.generate(req, timeout)
        except Exception as exc:  # noqa: BLE001
            return exc

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_requests_with_short_deadlines_complete_while_a_quarantined_request_runs(make_service):
    """A long solo run is under way; requests that arrive meanwhile with a 3 s deadline all finish
    in time (before: they were held until the solo run ended, and ran out of time)."""
    s = make_service()
    _, solo = s.submit(chat("the cat sat", solo=True, max_tokens=3000))
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="the solo run to start")
    results = generate_all(s, [chat(f"hello {i}") for i in range(8)], timeout=3.0)
    assert all(not isinstance(r, Exception) and len(r.token_ids) == 8 for r in results), results
    assert not solo.done()  # they ran beside the solo run, not after it
    assert len(solo.result(timeout=120).token_ids) == 3000
    assert (s.num_solo_runs, s.num_failures) == (1, 0)


def test_a_poison_request_fails_alone_without_draining_the_engine(make_service):
    """The poison request fails in its own steps while long requests run on beside it: they are
    neither struck nor held, and its verdict comes before they finish (before: it waited for the
    engine to drain, so the verdict came only after them)."""
    s = make_service(f"poison:{POISON}", max_rebuilds=1)
    running = [s.submit(chat(f"hello {i}", max_tokens=600))[1] for i in range(4)]
    wait_for(lambda: s.engine_stats.get("num_running") == 4, 30, what="the long requests to run")
    _, poison = s.submit(chat(f"the cat {POISON} sat", solo=True))
    with pytest.raises(EngineCrash, match="each of the 2 times it ran alone"):
        poison.result(timeout=60)
    assert not any(f.done() for f in running)  # they are carried over, and go on
    assert all(len(f.result(timeout=120).token_ids) == 600 for f in running)
    assert (s.num_failures, s.num_struck, s.num_poisoned, s.num_solo_runs) == (2, 0, 1, 2)


def test_a_failing_shared_step_does_not_count_against_the_suspect(make_service):
    """A not-yet-quarantined poison request fails a shared step while a quarantined request runs:
    the poison's step-mates are struck, the suspect (in none of those steps) is carried over without
    a failed solo run, starts its solo run again, and completes."""
    s = make_service(f"poison:{POISON}")
    _, solo = s.submit(chat("the cat sat", solo=True, max_tokens=300))
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="the solo run to start")
    _, poison = s.submit(chat(f"the dog {POISON} ran"))
    assert poison.exception(timeout=60).struck
    assert len(solo.result(timeout=120).token_ids) == 300
    assert (s.num_failures, s.num_struck, s.num_poisoned, s.num_solo_runs) == (1, 1, 0, 2)


def test_out_of_memory_in_an_isolated_step_shrinks_only_the_token_budget(tiny_model_dir):
    engine = LLMEngine(config(tiny_model_dir, max_num_seqs=8, max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"n{i}", [5, 6, 7], params)
    engine.step()  # the four normal requests run
    engine.add_request("iso", [5] * 200, params, isolated=True)
    seen: list[list[str]] = []
    fired = threading.Event()

    def hook(seqs):
        seen.append([s.request_id for s in seqs])
        if [s.request_id for s in seqs] == ["iso"] and not fired.is_set():
            fired.set()
            raise torch.OutOfMemoryError("injected: out of memory in the isolated prefill")

    engine.on_step_start = hook
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert fired.is_set() and engine.num_oom == 1
    sch = engine.scheduler
    assert sch.max_num_seqs == 8 and sch.max_num_batched_tokens == 100  # the 200-token chunk, halved
    assert all(ids == ["iso"] or "iso" not in ids for ids in seen)  # never batched with the others
    assert sorted(o.request_id for o in outputs) == ["iso", "n0", "n1", "n2", "n3"]


def test_the_wait_for_a_turn_alone_does_not_count_against_the_deadline(make_service):
    """Quarantined requests run alone one at a time; those waiting for their turn (innocents that
    shared a failing step with a poison request, most of them) do not lose their deadline to the wait:
    three quarantined requests with a 2 s deadline queue behind a solo run of several seconds and all
    complete; the wait is reported, not charged. Before: DeadlineExceeded for each."""
    s = make_service()
    _, first = s.submit(chat("the cat sat", solo=True, max_tokens=1500))
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="the first solo run to start")
    results = generate_all(s, [chat(f"hello {i}", solo=True, max_tokens=4) for i in range(3)], timeout=2.0)
    assert all(not isinstance(r, Exception) for r in results), results
    assert first.result(timeout=120).finish_reason == "length"
    assert all(len(r.token_ids) == 4 for r in results)


def test_the_wait_for_a_turn_alone_is_bounded_by_max_held(make_service):
    """``max_held`` caps the time that does not count (the task sets it from the visibility timeout, so
    a held request never outlives its message's lease): with no allowance the deadline is plain."""
    from batchery.contract.errors import DeadlineExceeded

    s = make_service()
    _, first = s.submit(chat("the cat sat", solo=True, max_tokens=6000))  # runs for seconds even on a fast CPU
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="the first solo run to start")
    with pytest.raises(DeadlineExceeded, match=r"deadline of 1 s exceeded"):
        s.generate(chat("hello", solo=True, max_tokens=4), 1.0, max_held=0.0)
    assert first.result(timeout=120).finish_reason == "length"


def test_a_death_suspect_runs_with_nothing_else_in_the_engine(make_service):
    """A request suspected of killing its worker process (``exclusive``, set by tasks/redelivery.py after two
    deaths) runs with nothing else in the engine, so a death during its run is its own: it starts once the
    engine has drained, normal requests that arrive meanwhile are held until it ends, and their deadlines stop
    while they are held (2 s deadlines behind a run of several seconds all complete)."""
    s = make_service()
    _, before = s.submit(chat("running already", max_tokens=300))
    wait_for(lambda: s.engine_stats.get("num_running"), 30, what="a normal request to be running")
    _, suspect = s.submit(chat("the cat sat", solo=True, exclusive=True, max_tokens=1500))
    wait_for(lambda: before.done() and s.engine_stats.get("num_running") == 1, 120, what="the drain, then the suspect")
    results = generate_all(s, [chat(f"hello {i}", max_tokens=4) for i in range(4)], timeout=2.0)
    assert all(not isinstance(r, Exception) for r in results), results
    first, done = before.result(timeout=5), suspect.result(timeout=5)
    assert done.added_at >= first.finished_at  # it started after the engine drained
    assert all(r.added_at >= done.finished_at for r in results)  # the others went in after it ended
