"""Async scheduling (``EngineConfig.async_scheduling``, vLLM v1's): step k+1 scheduled and packed while
step k runs, k's tokens committed one step late, decode inputs taken on the device from k's sampled ids.

On the CPU the setting is forced on and every workload is run twice on the tiny random-weight Llama,
pipelined and synchronous, from the same loaded weights: the outputs (tokens, text, finish reason,
logprobs, every choice) must be identical, with the pipelined path really taken (``num_async_steps``),
no request ever emitting a token past its stop, and every KV block back in the pool at the end.
Greedy and seeded rows only: an unseeded row draws from the engine's shared generator, whose stream
depends on the batch (a finished request's thrown-away row still draws), so it is reproducible in
neither mode. Workloads: max_tokens, EOS, stop strings and stop token ids, min_tokens, logprobs,
requests arriving and aborted mid-run, preemption in a tiny KV pool, n > 1, the prefix cache, the
decode-graph path (its static buffers, ``capture=False``), and the rows that need the previous token on
the host (penalties, grammars): those steps drain the pipeline and run as before."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import pytest
import torch

from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import LLMEngine, resolve_async_scheduling
from batchery.engine.loader import load_model
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import RequestOutput

TEXTS = [
    "hello world the cat",
    "once upon a time there was a dog",
    "summarize this text about the sea and the sky",
    "write a story about fire and rain",
    "the big red apple and the small green tree",
    "data model token batch queue worker engine",
]
_rid = itertools.count()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def prompts(tiny_model_dir, loaded):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16), loaded=loaded)
    return [eng.encode(t) for t in TEXTS]


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    at: int = 0  # added before this step() call
    abort_at: int | None = None  # aborted before this step() call
    rid: str = field(default_factory=lambda: f"r{next(_rid)}")


@dataclass
class Run:
    outputs: dict[str, RequestOutput]
    stats: dict
    engine: LLMEngine


def make_engine(tiny_model_dir, loaded, async_on: bool, **cfg) -> LLMEngine:
    cfg = {"num_kv_blocks": 256, **cfg}
    eng = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", async_scheduling=async_on, **cfg), loaded=loaded
    )
    assert eng.async_scheduling is async_on
    return eng


def run(eng: LLMEngine, reqs: list[Req], eos_ids: list[int] | None = None) -> Run:
    """Drive ``eng`` through ``reqs`` (arrivals and aborts at their step numbers); every request that is
    not aborted finishes exactly once, and the engine ends empty with every block free."""
    if eos_ids is not None:
        eng.eos_ids = eos_ids
    outs: dict[str, RequestOutput] = {}
    last = max([r.at for r in reqs] + [r.abort_at or 0 for r in reqs])
    for i in range(10_000):
        for r in reqs:
            if r.at == i:
                eng.add_request(r.rid, r.prompt, r.params)
            if r.abort_at == i:
                eng.abort(r.rid)
        if i > last and not eng.has_unfinished():
            break
        for o in eng.step():
            assert o.request_id not in outs, f"{o.request_id} finished twice"
            outs[o.request_id] = o
    else:
        raise AssertionError("the engine did not drain")
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], "KV blocks leaked"
    assert st["num_running"] == st["num_waiting"] == 0
    assert not eng.scheduler.deferred and not eng.scheduler.held and eng._pending is None
    return Run(outs, st, eng)


def fresh(reqs: list[Req]) -> list[Req]:
    """The same requests under new ids (for the second engine)."""
    return [Req(r.prompt, r.params, r.at, r.abort_at) for r in reqs]


def view(o: RequestOutput) -> list[tuple]:
    """Everything a request's output says but its logprobs' values (``logprob_values``)."""

    def lp(e) -> tuple:
        return (e["token_id"], [t for t, _ in e["top"]])

    return [
        (c.index, c.token_ids, c.text, c.finish_reason, None if c.logprobs is None else [lp(e) for e in c.logprobs])
        for c in o.outputs
    ]


def logprob_values(o: RequestOutput) -> list[float]:
    """The logprob values of every choice, compared within 1e-5: a batch of another make-up (the pipelined
    engine's batches differ by the rows of requests that just stopped, and preemption can differ) sums a
    matmul in another order, which moves a logprob in its last float32 bits."""
    return [v for c in o.outputs for e in c.logprobs or [] for v in [e["logprob"], *(x for _, x in e["top"])]]


def compare(tiny_model_dir, loaded, reqs: list[Req], eos_ids=None, **cfg) -> tuple[Run, Run]:
    """``reqs`` on a synchronous and on a pipelined engine: identical outputs request by request (both
    runs' outputs are returned under ``reqs``' ids)."""
    sync = run(make_engine(tiny_model_dir, loaded, False, **cfg), reqs, eos_ids)
    again = fresh(reqs)
    pipe = run(make_engine(tiny_model_dir, loaded, True, **cfg), again, eos_ids)
    assert sync.stats["num_async_steps"] == 0
    assert pipe.stats["num_async_steps"] > 0, "the pipelined path was never taken"
    aborted = {i for i, r in enumerate(reqs) if r.abort_at is not None}
    for i, (a, b) in enumerate(zip(reqs, again, strict=True)):
        if i in aborted:
            # an abort that comes after the request finished is a no-op, and outputs come one step later
            # when pipelined: such a request may be reported by one engine and aborted in the other
            if a.rid not in sync.outputs or b.rid not in pipe.outputs:
                continue
        assert view(sync.outputs[a.rid]) == view(pipe.outputs[b.rid]), f"request {i} differs"
        assert logprob_values(sync.outputs[a.rid]) == pytest.approx(logprob_values(pipe.outputs[b.rid]), abs=1e-5)
    pipe.outputs = {a.rid: pipe.outputs[b.rid] for a, b in zip(reqs, again, strict=True) if b.rid in pipe.outputs}
    return sync, pipe


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 12, **kw})


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, ignore_eos=True, **{"max_tokens": 12, **kw})


@pytest.fixture(scope="module")
def reference(tiny_model_dir, loaded, prompts):
    """Greedy continuations (16 tokens) of every prompt, synchronous."""
    reqs = [Req(p, greedy(max_tokens=16)) for p in prompts]
    r = run(make_engine(tiny_model_dir, loaded, False), reqs)
    return [r.outputs[q.rid].token_ids for q in reqs]


# -- the setting ---------------------------------------------------------------------------------


def test_auto_is_on_for_cuda_only_and_the_setting_is_checked():
    assert resolve_async_scheduling("auto", torch.device("cuda")) is True
    assert resolve_async_scheduling("auto", torch.device("cpu")) is False
    assert resolve_async_scheduling(True, torch.device("cpu")) is True
    assert resolve_async_scheduling(False, torch.device("cuda")) is False
    assert EngineConfig().async_scheduling == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="async_scheduling"):
            EngineConfig(async_scheduling=bad)


def test_the_cpu_default_is_synchronous(tiny_model_dir, loaded, prompts):
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64), loaded=loaded)
    assert eng.async_scheduling is False
    r = run(eng, [Req(prompts[0], greedy())])
    assert r.stats["num_async_steps"] == 0 and r.stats["num_async_drains"] == 0


# -- identical outputs ---------------------------------------------------------------------------


def test_greedy_and_seeded_batches_are_identical(tiny_model_dir, loaded, prompts, reference):
    reqs = [Req(p, greedy(max_tokens=16)) for p in prompts] + [
        Req(p, seeded(s, max_tokens=9 + s)) for s, p in enumerate(prompts)
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs)
    assert [sync.outputs[r.rid].token_ids for r in reqs[: len(prompts)]] == reference
    for r in reqs:
        assert len(sync.outputs[r.rid].token_ids) == r.params.max_tokens  # never one past max_tokens
    # every step but the first ran while the one before it was on the device
    assert pipe.stats["num_async_steps"] == pipe.stats["num_steps"] - 1
    assert pipe.stats["num_async_drains"] == 0


def test_logprobs_ride_along(tiny_model_dir, loaded, prompts):
    reqs = [
        Req(prompts[0], greedy(logprobs=3)),
        Req(prompts[1], seeded(4, logprobs=0)),
        Req(prompts[2], seeded(5)),
        Req(prompts[3], greedy(logprobs=1, max_tokens=7)),
    ]
    sync, _ = compare(tiny_model_dir, loaded, reqs)
    assert len(sync.outputs[reqs[0].rid].logprobs) == 12


def _stop_token(reference: list[int], k: int) -> int:
    """A token of ``reference`` whose first occurrence is at index >= k."""
    for i in range(k, len(reference)):
        if reference[i] not in reference[:i]:
            return reference[i]
    raise AssertionError("no fresh token")


def test_eos_stop_tokens_and_min_tokens_finish_at_the_same_token(tiny_model_dir, loaded, prompts, reference):
    eos = _stop_token(reference[0], 3)
    stop = _stop_token(reference[1], 2)
    k_eos = reference[0].index(eos)
    reqs = [
        Req(prompts[0], SamplingParams(temperature=0, max_tokens=16)),  # EOS at k_eos
        Req(prompts[1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], ignore_eos=True)),
        Req(prompts[0], SamplingParams(temperature=0, max_tokens=16, min_tokens=k_eos + 2)),
        Req(prompts[2], greedy(max_tokens=16)),  # runs on after the others stopped
        Req(prompts[3], seeded(9, max_tokens=16, stop_token_ids=[stop, eos])),
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs, eos_ids=[eos])
    o = pipe.outputs[reqs[0].rid]
    assert o.finish_reason == "stop" and o.token_ids == reference[0][: k_eos + 1]  # nothing after the EOS
    o = pipe.outputs[reqs[1].rid]
    assert o.finish_reason == "stop" and o.token_ids == reference[1][: reference[1].index(stop) + 1]
    assert eos not in pipe.outputs[reqs[2].rid].token_ids[: k_eos + 2]
    # the rows computed after a stop, thrown away, are the only extra steps
    assert pipe.stats["num_generated_tokens"] == sync.stats["num_generated_tokens"]


def test_stop_strings(tiny_model_dir, loaded, prompts, reference):
    eng = make_engine(tiny_model_dir, loaded, False)
    word = eng.tokenizer.decode([reference[2][5]]).strip()
    reqs = [
        Req(prompts[2], SamplingParams(temperature=0, max_tokens=16, stop=[word], ignore_eos=True)),
        Req(prompts[0], SamplingParams(temperature=0, max_tokens=16, stop=[word, "zzz"], ignore_eos=True)),
        Req(prompts[1], seeded(3, max_tokens=16, stop=[word])),
    ]
    sync, _ = compare(tiny_model_dir, loaded, reqs)
    assert sync.outputs[reqs[0].rid].finish_reason == "stop"
    assert word not in sync.outputs[reqs[0].rid].text


def test_arrivals_and_aborts_mid_run(tiny_model_dir, loaded, prompts):
    reqs = [
        Req(prompts[0], greedy(max_tokens=20)),
        Req(prompts[1], seeded(1, max_tokens=20), abort_at=4),
        Req(prompts[2], greedy(max_tokens=10), at=2),
        Req(prompts[3], seeded(2, max_tokens=14), at=3),
        Req(prompts[4], greedy(max_tokens=16), at=5, abort_at=9),
        Req(prompts[5], greedy(max_tokens=8), at=11),
        Req(prompts[0], seeded(3, max_tokens=6), at=11, abort_at=11),  # aborted before it ever ran
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs)
    for r in (reqs[1], reqs[4], reqs[6]):  # all aborted long before their last token
        assert r.rid not in sync.outputs and r.rid not in pipe.outputs


def test_aborting_everything_mid_run_frees_every_block(tiny_model_dir, loaded, prompts):
    eng = make_engine(tiny_model_dir, loaded, True)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"a{i}", p, greedy(max_tokens=30))
    for _ in range(4):
        assert eng.step() == []
    assert eng._pending is not None
    for i in range(3):
        assert eng.abort(f"a{i}")
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and eng._pending is None
    assert not eng.has_unfinished() and eng.step() == []


def test_preemption_in_a_tiny_kv_pool(tiny_model_dir, loaded, prompts):
    reqs = [Req(p, greedy(max_tokens=24)) for p in prompts[:4]] + [
        Req(p, seeded(s, max_tokens=20)) for s, p in enumerate(prompts[4:])
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs, num_kv_blocks=14, block_size=4)
    assert sync.stats["num_preemptions"] > 0 and pipe.stats["num_preemptions"] > 0


def test_chunked_prefill_under_a_small_token_budget(tiny_model_dir, loaded, prompts):
    long = prompts[2] + prompts[3] + prompts[1]
    reqs = [Req(long, greedy(max_tokens=10)), Req(prompts[0], seeded(7)), Req(prompts[4], greedy(), at=3)]
    compare(tiny_model_dir, loaded, reqs, max_num_batched_tokens=6, block_size=4)


def test_n_choices(tiny_model_dir, loaded, prompts):
    reqs = [
        Req(prompts[0], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)),
        Req(prompts[1], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)),
        Req(prompts[2], seeded(5), at=2),
        Req(prompts[3], SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=1, ignore_eos=True)),
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs)
    assert pipe.stats["num_forked_choices"] == sync.stats["num_forked_choices"] > 0
    assert len(pipe.outputs[reqs[0].rid].outputs) == 3


def test_prefix_cache_hits(tiny_model_dir, loaded, prompts):
    shared = prompts[2] + prompts[3] + prompts[4]
    reqs = [Req(shared + p, greedy(max_tokens=8), at=i) for i, p in enumerate(prompts)]
    reqs.append(Req(shared + prompts[0], greedy(max_tokens=8), at=12))  # after the first finished
    sync, pipe = compare(tiny_model_dir, loaded, reqs, block_size=4)
    assert pipe.stats["prefix_cache_hit_tokens"] > 0
    assert sync.stats["prefix_cache_hit_tokens"] > 0


def test_length_limited_rows_are_not_scheduled_past_their_last_token(tiny_model_dir, loaded, prompts):
    """A row whose placeholder is its last token (max_tokens) is not scheduled again: the pipelined engine
    runs exactly the synchronous engine's steps."""
    reqs = [Req(p, greedy(max_tokens=5 + i)) for i, p in enumerate(prompts)]
    sync, pipe = compare(tiny_model_dir, loaded, reqs)
    assert pipe.stats["num_steps"] == sync.stats["num_steps"]


def test_a_stopped_row_is_computed_once_more_and_thrown_away(tiny_model_dir, loaded, prompts, reference):
    """A request stopped by its token (not by its length) was in the next step already: that row is
    computed, its token dropped, and its blocks wait for that step before going back to the pool."""
    eos = _stop_token(reference[0], 3)
    k = reference[0].index(eos)
    eng = make_engine(tiny_model_dir, loaded, True)
    eng.eos_ids = [eos]
    eng.add_request("stop", prompts[0], SamplingParams(temperature=0, max_tokens=16))
    eng.add_request("long", prompts[1], greedy(max_tokens=16))
    seq = eng.requests["stop"]
    outs = []
    for _ in range(k + 1):
        outs += eng.step()
    assert outs == [] and seq.num_output_tokens == k + 1  # its EOS is a placeholder, on the device
    outs = eng.step()  # launches the next step, then commits the EOS
    assert [o.request_id for o in outs] == ["stop"] and outs[0].token_ids == reference[0][: k + 1]
    assert seq.is_finished and seq.block_table and eng.scheduler.deferred == [seq]  # the next step writes them
    free = eng.stats()["kv_blocks_free"]
    eng.step()
    assert not eng.scheduler.deferred and seq.block_table == [] and eng.stats()["kv_blocks_free"] > free
    assert seq.token_ids[seq.num_prompt_tokens :] == reference[0][: k + 1]  # no token after the EOS
    while eng.has_unfinished():
        eng.step()


# -- the rows that need the previous token on the host -------------------------------------------


def test_penalised_rows_drain_the_pipeline(tiny_model_dir, loaded, prompts):
    reqs = [
        Req(prompts[0], greedy(repetition_penalty=1.5, max_tokens=10)),
        Req(prompts[1], greedy(frequency_penalty=0.5, presence_penalty=0.3, max_tokens=14)),
        Req(prompts[2], greedy(max_tokens=20)),
        Req(prompts[3], seeded(2, max_tokens=20), at=4),
    ]
    sync, pipe = compare(tiny_model_dir, loaded, reqs)
    assert pipe.stats["num_async_drains"] > 0
    assert sync.outputs[reqs[0].rid].token_ids != greedy_plain(tiny_model_dir, loaded, prompts[0], 10)


def greedy_plain(tiny_model_dir, loaded, prompt, n) -> list[int]:
    req = Req(prompt, greedy(max_tokens=n))
    return run(make_engine(tiny_model_dir, loaded, False), [req]).outputs[req.rid].token_ids


@pytest.fixture()
def interpreter_scalar_index(monkeypatch):
    """triton-lang/triton#9171 in the CPU interpreter (as in tests/test_gpu_readiness.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the decode graphs' path needs the Triton backend (TRITON_INTERPRET=1 on the CPU)")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def test_decode_graph_buffers_take_the_placeholders_on_the_device(
    tiny_model_dir, loaded, prompts, interpreter_scalar_index
):
    """The decode-graph path (its static buffers; no capture on the CPU) under async scheduling: the
    placeholder ids are replaced in the graphs' input buffer before the forward."""
    runs = []
    for async_on in (False, True):
        eng = make_engine(tiny_model_dir, loaded, async_on, attention_backend="triton", max_num_seqs=8)
        eng.runner.graphs = eng.runner.build_decode_graphs(capture=False)
        reqs = [Req(p, greedy(max_tokens=6)) for p in prompts[:3]] + [Req(prompts[3], seeded(1, max_tokens=6))]
        r = run(eng, reqs)
        assert r.stats["cuda_graph_steps"] > 0
        runs.append([r.outputs[q.rid].token_ids for q in reqs])
        if async_on:
            assert r.stats["num_async_steps"] > 0
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer (grammars need real byte-level tokens)."""
    from test_structured_outputs import build_smol_tiny

    path = build_smol_tiny(tmp_path_factory.mktemp("smol-tiny-async"))
    return path, load_model(EngineConfig(model=str(path), dtype="float32"))


def test_constrained_rows_fall_back_beside_pipelined_ones(smol):
    path, smol_loaded = smol
    tok = smol_loaded.tokenizer
    prompt = tok("Reply in JSON.")["input_ids"]
    other = tok("Once upon a time")["input_ids"]
    so = {"structured_outputs": {"regex": r"(INV|REF)-[0-9]{3}-[a-z]{2,5}"}}
    choice = {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}
    reqs = [
        Req(other, greedy(max_tokens=10)),
        Req(other, seeded(3, max_tokens=14)),
        Req(prompt, SamplingParams(temperature=0, max_tokens=40, **so), at=3),
        Req(prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=40, **choice), at=3),
        Req(other, greedy(max_tokens=6), at=12),
    ]
    sync, pipe = compare(path, smol_loaded, reqs)
    assert pipe.stats["num_async_drains"] > 0
    assert sync.outputs[reqs[2].rid].finish_reason == "stop"
    assert sync.outputs[reqs[3].rid].text in ("positive", "negative", "neutral")


def test_an_oom_step_drains_the_pipeline_and_changes_no_output(tiny_model_dir, loaded, prompts):
    """An out-of-memory launch commits the step before it first, then shrinks as the synchronous engine
    does (nothing of the failed step was committed)."""
    reqs = [Req(p, greedy(max_tokens=14)) for p in prompts] + [Req(prompts[0], seeded(8, max_tokens=14))]
    sync = run(make_engine(tiny_model_dir, loaded, False, max_num_seqs=8), reqs)
    eng = make_engine(tiny_model_dir, loaded, True, max_num_seqs=8)
    calls, in_flight = [0], []

    def hook(seqs):
        calls[0] += 1
        if calls[0] in (3, 6):
            in_flight.append(eng._pending is not None)
            raise torch.OutOfMemoryError(f"injected at call {calls[0]}")

    eng.on_step_start = hook
    again = fresh(reqs)
    pipe = run(eng, again)
    assert eng.num_oom == 2 and pipe.stats["num_async_steps"] > 0
    assert in_flight == [True, True]  # each OOM came while the step before was on the device
    for a, b in zip(reqs, again, strict=True):
        assert view(sync.outputs[a.rid]) == view(pipe.outputs[b.rid])
        assert logprob_values(sync.outputs[a.rid]) == pytest.approx(logprob_values(pipe.outputs[b.rid]), abs=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_are_identical(tiny_model_dir, loaded, prompts, reference, seed):
    """Random mixes of everything above at once: arrivals and aborts at random steps, greedy and seeded
    rows, n > 1, stop tokens, min_tokens, logprobs, max_tokens from 1, a small pool (preemption) and a
    small token budget (chunked prefills)."""
    import random

    rng = random.Random(seed)
    stops = sorted({t for ref in reference for t in ref[2:6]})
    reqs = []
    for _ in range(rng.randint(5, 10)):
        prompt = rng.choice(prompts) + rng.choice([[], rng.choice(prompts)])
        kw: dict = {"max_tokens": rng.randint(1, 18), "ignore_eos": True}
        if rng.random() < 0.5:
            kw.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000))
        else:
            kw.update(temperature=0)
        if rng.random() < 0.3:
            kw["n"] = rng.randint(2, 3)
            if kw["temperature"] == 0:
                kw.update(temperature=1.0, seed=rng.randrange(1000))
        if rng.random() < 0.4:
            kw["stop_token_ids"] = rng.sample(stops, 2)
            if rng.random() < 0.5:
                kw["min_tokens"] = rng.randint(1, 4)
        if rng.random() < 0.3:
            kw["logprobs"] = rng.randint(0, 2)
        at = rng.randint(0, 12)
        abort_at = at + rng.randint(0, 8) if rng.random() < 0.2 else None
        reqs.append(Req(prompt, SamplingParams(**kw), at=at, abort_at=abort_at))
    cfg = {"block_size": 4, "num_kv_blocks": rng.choice([24, 40, 256]), "max_num_batched_tokens": rng.choice([8, 64])}
    compare(tiny_model_dir, loaded, reqs, **cfg)
