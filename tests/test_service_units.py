"""The engine service's parts one at a time, without threads: the state enum and the typed stats,
request intake, logprob rendering, triage and the watchdog's verdict, the quarantine lanes, the
canary, and the loop's apply / step hook / resolve driven by hand on the real tiny engine. (The
service with its threads is in test_worker_service.py and test_reliability.py.)"""

from __future__ import annotations

import json
import threading
import time

import pytest

from batchery.contract.errors import ContextLengthExceeded, EngineCrash, EngineFailure, InvalidRequest
from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import LLMEngine, PromptTooLong
from batchery.worker.service import EngineService, EngineState, GenerationRequest
from batchery.worker.service.admission import Lanes
from batchery.worker.service.canary import CANARY_ID, run_canary
from batchery.worker.service.faults import InjectedFault, parse_faults
from batchery.worker.service.intake import EngineInput, Pending, engine_input, request_error
from batchery.worker.service.logprobs import LogprobRenderer
from batchery.worker.service.loop import EngineLoop
from batchery.worker.service.shared import AbortOp, AddOp, EngineAbandoned, ServiceOptions, Shared
from batchery.worker.service.stats import Health, ServiceStats
from batchery.worker.service.step_stats import StepStats
from batchery.worker.service.triage import poison_error, struck_error, triage, watchdog_reason

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        max_num_seqs=16,
        num_kv_blocks=128,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
    )


@pytest.fixture(scope="module")
def loaded(config):
    return LLMEngine(config).loaded


@pytest.fixture()
def engine(config, loaded) -> LLMEngine:
    return LLMEngine(config, loaded=loaded)  # a fresh engine (scheduler, KV pool) on the loaded weights


def chat(text: str = "hello world", *, solo: bool = False, **sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": text}],
        solo=solo,
        sampling={"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **sampling},
    )


def pending(
    rid: str,
    request: GenerationRequest | None = None,
    *,
    in_engine: bool = False,
    solo_failures: int = 0,
    submitted_at: float | None = None,
) -> Pending:
    p = Pending.new(rid, request or chat())
    p.in_engine, p.solo_failures = in_engine, solo_failures
    if submitted_at is not None:
        p.submitted_at = submitted_at
    return p


# -- state and stats ----------------------------------------------------------------------------------
def test_engine_state_values_are_the_documented_strings():
    from batchery.worker import metrics

    assert [s.value for s in EngineState] == ["new", "serving", "rebuilding", "draining", "failed", "stopped"]
    assert metrics.ENGINE_STATES == tuple(s.value for s in EngineState)
    assert json.dumps({"state": EngineState.SERVING}) == '{"state": "serving"}'
    assert f"{EngineState.REBUILDING}" == "rebuilding" and EngineState.FAILED == "failed"


def test_service_stats_as_dict():
    st = ServiceStats(model_name="m", dtype="bfloat16", step_seconds=1.23456789, engine={"num_running": 2})
    steps = StepStats()
    assert [steps.start(n) for n in (1, 2, 3, 4)] == [1, 2, 3, 4]  # numbered from 1
    d = st.as_dict(EngineState.SERVING, num_pending=3, steps=steps)
    assert list(d) == [
        "model",
        "dtype",
        "num_kv_blocks",
        "max_model_len",
        "state",
        "num_pending",
        "num_requests",
        "num_finished",
        "num_aborted",
        "num_steps",
        "num_step_seqs",
        "num_step_tokens",
        "step_seconds",
        "mean_batch_size",
        "num_failures",
        "num_rebuilds",
        "num_struck",
        "num_carried_over",
        "num_solo_runs",
        "num_poisoned",
        "engine",
    ]
    assert d["state"] == "serving" and type(d["state"]) is str and d["num_pending"] == 3
    assert d["num_steps"] == 4 and d["num_step_seqs"] == 10 and d["num_step_tokens"] == 0
    assert d["mean_batch_size"] == 2.5 and d["step_seconds"] == 1.234568
    d["engine"]["num_running"] = 99  # a copy: the caller cannot change the service's counters
    assert st.engine == {"num_running": 2}
    assert (
        ServiceStats().as_dict(EngineState.NEW, 0, StepStats())["mean_batch_size"] == 0.0
    )  # no steps: no division by zero


@pytest.mark.parametrize(
    "state, loop_alive, healthy",
    [
        (EngineState.SERVING, True, True),
        (EngineState.DRAINING, True, True),
        (EngineState.SERVING, False, False),
        (EngineState.REBUILDING, False, True),
        (EngineState.NEW, False, False),
        (EngineState.FAILED, True, False),
        (EngineState.STOPPED, False, False),
    ],
)
def test_health(state, loop_alive, healthy):
    h = Health(state, loop_alive, None, 0.12345, 2, None)
    d = h.as_dict()
    assert d == {
        "healthy": healthy,
        "state": state.value,
        "loop_alive": loop_alive,
        "last_step_age_s": None,
        "last_loop_beat_age_s": 0.123,
        "num_pending": 2,
        "fatal_reason": None,
    }
    assert Health(state, loop_alive, 1.00049, 0.0, 0, "x").as_dict()["last_step_age_s"] == 1.0


def test_a_service_that_never_started_reports_new():
    s = EngineService(None)
    assert s.stats()["state"] == "new" and s.health() == {
        "healthy": False,
        "state": "new",
        "loop_alive": False,
        "last_step_age_s": None,
        "last_loop_beat_age_s": s.health()["last_loop_beat_age_s"],
        "num_pending": 0,
        "fatal_reason": None,
    }
    assert not s.ready and not s.fatal and s.num_kv_blocks == 0 and s.engine_stats == {}


# -- intake -------------------------------------------------------------------------------------------
def test_engine_input_from_messages_prompt_and_token_ids(engine):
    msgs = engine_input(engine, chat("hello world"))
    assert isinstance(msgs, EngineInput)
    assert msgs.prompt_token_ids == engine.encode_chat([{"role": "user", "content": "hello world"}])
    assert msgs.params.max_tokens == 4 and msgs.params.temperature == 0.0
    prompt = engine_input(engine, GenerationRequest(prompt="once upon a time"))
    assert isinstance(prompt, EngineInput) and prompt.prompt_token_ids == engine.encode("once upon a time")
    ids = engine_input(engine, GenerationRequest(prompt_token_ids=[7, 8, 9], sampling={"max_tokens": None}))
    assert isinstance(ids, EngineInput) and ids.prompt_token_ids == [7, 8, 9]
    assert ids.params.max_tokens == MAX_MODEL_LEN - 3  # None fills the context
    full = engine_input(engine, GenerationRequest(prompt_token_ids=[5] * MAX_MODEL_LEN))
    assert isinstance(full, EngineInput) and full.params.max_tokens == 1  # never below 1: add_request refuses it


def test_engine_input_returns_the_request_error(engine):
    bad_template = engine_input(engine, GenerationRequest(prompt=123))  # type: ignore[arg-type]
    assert type(bad_template) is InvalidRequest and str(bad_template).startswith("could not tokenize the request: ")
    bad_value = engine_input(engine, chat(temperature=-1.0))
    assert type(bad_value) is InvalidRequest and "temperature" in str(bad_value)
    unknown = engine_input(engine, chat(no_such_option=1))
    assert type(unknown) is InvalidRequest and "no_such_option" in str(unknown)
    assert type(request_error(PromptTooLong("too long"))) is ContextLengthExceeded
    assert type(request_error(ValueError("the prompt is empty"))) is InvalidRequest


def test_prompt_text_is_what_the_client_sent():
    msgs = GenerationRequest(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": None},
            {"role": "user", "content": "hi"},
        ]
    )
    assert Pending.new("a", msgs).prompt_text() == "be brief\n\nhi"
    assert Pending.new("b", GenerationRequest(prompt="once")).prompt_text() == "once"
    assert Pending.new("c", GenerationRequest(prompt_token_ids=[1, 2])).prompt_text() is None


# -- logprobs -----------------------------------------------------------------------------------------
def test_logprob_rendering(engine):
    tok = engine.tokenizer
    r = LogprobRenderer()
    a, b = engine.encode("hello world")[:2]
    entries = [{"token_id": a, "logprob": -0.5, "top": [(a, -0.5), (b, -1.25)]}, {"token_id": b, "logprob": -2}]
    out = r.render(tok, entries)
    assert out == [
        {
            "token": tok.decode([a]),
            "token_id": a,
            "logprob": -0.5,
            "top": [
                {"token": tok.decode([a]), "token_id": a, "logprob": -0.5},
                {"token": tok.decode([b]), "token_id": b, "logprob": -1.25},
            ],
        },
        {"token": tok.decode([b]), "token_id": b, "logprob": -2.0, "top": []},
    ]
    assert out[0]["token"] == "hello" and isinstance(out[1]["logprob"], float)
    assert r.render(tok, None) is None and r.render(tok, []) == []


# -- triage -------------------------------------------------------------------------------------------
def test_triage_strikes_only_the_failing_step_and_carries_the_rest_oldest_first():
    in_step = pending("in-step", in_engine=True, submitted_at=3.0)
    waiting = pending("waiting-in-engine", in_engine=True, submitted_at=2.0)
    not_added = pending("not-yet-added", submitted_at=1.0)
    t = triage([in_step, waiting, not_added], {"in-step"}, solo_attempts=2)
    assert t.struck == [in_step] and t.poisoned == []
    assert [p.request_id for p in t.carried] == ["not-yet-added", "waiting-in-engine"]
    assert not any(p.in_engine for p in t.carried)


def test_triage_outside_a_step_strikes_nobody():
    a, b, c = pending("a", in_engine=True), pending("b", in_engine=True), pending("c")
    t = triage([a, b, c], set(), solo_attempts=2)
    assert t.struck == [] and t.poisoned == [] and t.carried == [a, b, c]


def test_triage_outside_a_step_strikes_the_request_the_loop_was_taking_in():
    """The watchdog fired while the loop tokenized ``busy`` (not in the engine yet): it alone pays,
    and a quarantined one counts a failed solo run."""
    a, busy = pending("a", in_engine=True), pending("busy")
    t = triage([a, busy], set(), solo_attempts=2, busy="busy")
    assert t.struck == [busy] and t.carried == [a]
    solo = pending("solo", chat(solo=True))
    t = triage([solo], set(), solo_attempts=2, busy="solo")
    assert t.carried == [solo] and solo.solo_failures == 1


def test_triage_quarantine_counts_solo_failures_then_poisons():
    solo = pending("solo", chat(solo=True), in_engine=True)
    t = triage([solo], {"solo"}, solo_attempts=2)
    assert t.carried == [solo] and solo.solo_failures == 1 and not solo.in_engine  # innocent until shown twice
    solo.in_engine = True
    t = triage([solo], {"solo"}, solo_attempts=2)
    assert t.poisoned == [solo] and t.struck == [] and t.carried == [] and solo.solo_failures == 2
    bystander = pending("other-solo", chat(solo=True))  # quarantined but not in the engine: not hit
    assert triage([bystander], {"solo"}, solo_attempts=1).carried == [bystander] and bystander.solo_failures == 0


def test_triage_errors():
    retry = struck_error("the engine loop raised RuntimeError")
    assert isinstance(retry, EngineFailure) and retry.retryable and retry.struck
    assert str(retry) == "engine failure (the engine loop raised RuntimeError); the request will be retried"
    p = pending("x", chat(solo=True), solo_failures=2)
    crash = poison_error(p, "InjectedFault: boom")
    assert isinstance(crash, EngineCrash) and not crash.retryable
    assert str(crash).startswith("the request crashed the engine each of the 2 times it ran alone")
    assert str(crash).endswith("last: InjectedFault: boom")
    assert len(str(poison_error(p, "x" * 5000))) == 2000


def test_watchdog_reason():
    assert watchdog_reason(1.0, 1.0, 3, False) is None  # at the limit is not past it
    assert watchdog_reason(2.04, 1.0, 3, False) == (
        "the watchdog fired: 3 requests pending and no engine step finished for 2.0 s (limit 1 s)"
    )
    assert watchdog_reason(7.0, 0.5, 0, True).startswith("the watchdog fired: the canary step pending")


# -- admission (quarantine lanes), on the real engine ------------------------------------------------------
class Adder:
    """Puts requests into the engine the way the loop does (engine_input, then add_request)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.added: list[str] = []

    def __call__(self, p: Pending) -> bool:
        inp = engine_input(self.engine, p.request)
        assert isinstance(inp, EngineInput)
        self.engine.add_request(p.request_id, inp.prompt_token_ids, inp.params, isolated=p.request.solo)
        self.added.append(p.request_id)
        return True


def test_lanes_route_normal_work_straight_in():
    lanes = Lanes()
    assert lanes.place(pending("a")) and not lanes


def test_lanes_put_one_quarantined_request_at_a_time_beside_the_others(engine):
    """No drain and no holding: normal work goes straight in while a quarantined request waits or
    runs (the engine runs it in steps of its own); the next quarantined one goes in when it is over."""
    lanes, add = Lanes(), Adder(engine)
    assert lanes.place(pending("busy")) and add(pending("busy"))
    assert not lanes.place(pending("solo-1", chat(solo=True)))
    assert not lanes.place(pending("solo-2", chat(solo=True)))
    started = lanes.admit(engine, add)  # the engine is not empty: no matter
    assert [p.request_id for p in started] == ["solo-1"] and lanes.solo_rid == "solo-1"
    assert lanes.place(pending("normal"))  # not held
    assert lanes.admit(engine, add) == []  # solo-1 still runs: solo-2 waits its turn
    assert engine.requests["solo-1"].isolated and not engine.requests["busy"].isolated
    engine.abort("solo-1")
    assert [p.request_id for p in lanes.admit(engine, add)] == ["solo-2"] and not lanes
    assert add.added == ["busy", "solo-1", "solo-2"]


def test_lanes_a_rerun_after_failing_alone_goes_first():
    lanes = Lanes()
    lanes.place(pending("first", chat(solo=True)))
    lanes.place(pending("rerun", chat(solo=True), solo_failures=1))
    assert [p.request_id for p in lanes.solo] == ["rerun", "first"]


def test_lanes_skip_a_quarantined_request_that_is_refused(engine):
    lanes, added = Lanes(), []

    def add(p: Pending) -> bool:
        if p.request_id == "refused":
            return False
        added.append(p.request_id)
        engine.add_request(p.request_id, [5, 6], engine_input(engine, p.request).params)
        return True

    lanes.place(pending("refused", chat(solo=True)))
    lanes.place(pending("next", chat(solo=True)))
    assert [p.request_id for p in lanes.admit(engine, add)] == ["next"] and added == ["next"]


# -- the canary --------------------------------------------------------------------------------------------
def test_canary_runs_two_tokens_and_leaves_the_engine_empty(engine):
    run_canary(engine, threading.Event())
    assert not engine.has_unfinished() and engine.num_steps == 2


def test_canary_stops_when_abandoned(engine):
    abandoned = threading.Event()
    abandoned.set()
    run_canary(engine, abandoned)
    assert CANARY_ID in engine.requests and engine.num_steps == 0


# -- the loop, driven by hand ------------------------------------------------------------------------------
def hand_loop(config: EngineConfig, engine: LLMEngine, faults: str = "") -> tuple[Shared, EngineLoop]:
    shared = Shared(config, ServiceOptions(faults=tuple(parse_faults(faults))))
    loop = EngineLoop(shared, 0, engine, threading.Event())
    engine.on_step_start = loop.on_step_start
    return shared, loop


def submit(shared: Shared, p: Pending) -> AddOp:
    shared.pending[p.request_id] = p
    return AddOp(p)


def test_loop_apply_step_and_resolve(config, engine):
    shared, loop = hand_loop(config, engine)
    ok = pending("ok", chat(logprobs=1))
    bad = pending("bad", chat(temperature=-1.0))
    gone = pending("gone")  # aborted before the loop saw it: not in the pending set
    t0 = time.time()
    loop.apply([submit(shared, ok), submit(shared, bad), AddOp(gone)], Lanes())
    assert ok.in_engine and list(engine.requests) == ["ok"] and ok.added_at >= t0
    with pytest.raises(InvalidRequest, match="temperature"):
        bad.future.result(timeout=0)
    assert "bad" not in shared.pending and not gone.future.done()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert shared.step_stats.num_started == engine.num_steps and shared.step_rids == ("ok",)
    loop.resolve(outputs)
    r = ok.future.result(timeout=0)
    assert len(r.token_ids) == 4 and r.finish_reason == "length" and len(r.logprobs) == 4
    assert r.submitted_at <= r.added_at <= r.finished_at and shared.stats.num_finished == 1 and not shared.pending


def test_loop_apply_aborts_free_the_engine(config, engine):
    shared, loop = hand_loop(config, engine)
    loop.apply([submit(shared, pending("a"))], Lanes())
    shared.pending.pop("a")
    loop.apply([AbortOp("a")], Lanes())
    assert not engine.has_unfinished()


def test_loop_step_hook_runs_faults_and_unwinds_an_abandoned_engine(config, engine):
    shared, loop = hand_loop(config, engine, "step_raise:2")
    loop.apply([submit(shared, pending("a", chat(max_tokens=8)))], Lanes())
    engine.step()
    with pytest.raises(InjectedFault, match="step 2"):
        engine.step()
    assert shared.step_stats.num_started == 2 and shared.step_stats.num_started_seqs == 2
    shared.in_canary = True
    engine.step()  # the canary's steps are not counted and meet no fault
    assert shared.step_stats.num_started == 2
    loop.abandoned.set()
    with pytest.raises(EngineAbandoned):
        engine.step()


def test_loop_quarantined_request_counts_a_solo_run(config, engine, caplog):
    shared, loop = hand_loop(config, engine)
    lanes = Lanes()
    solo = pending("solo", chat(solo=True))
    loop.apply([submit(shared, pending("first", chat(max_tokens=8)))], lanes)
    loop.apply([submit(shared, solo)], lanes)  # no drain: it goes in beside the running request
    assert lanes.solo_rid == "solo" and shared.stats.num_solo_runs == 1 and solo.in_engine
    assert engine.requests["solo"].isolated and not engine.requests["first"].isolated
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(shared.step_rids)
    assert ("solo",) in steps and all(rids == ("solo",) or "solo" not in rids for rids in steps)
    assert "quarantine: running request solo alone (solo run 1 of at most 2)" in caplog.text
