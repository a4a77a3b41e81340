"""The engine's sampling and request handling on the tiny random Llama: seeded / unseeded sampling,
top-k / top-p / min-p, penalties, stop strings and stop tokens, max_tokens, EOS handling
(ignore_eos, min_tokens), logprobs, abort, block accounting, parameter validation and the
errors ``add_request`` / ``LLM.generate`` give for unusable prompts.

The tiny model's next-token distribution is close to uniform over ~190 tokens, so two unseeded
samples of 16 tokens never agree by chance, and any filter that does not reduce to greedy shows."""

from __future__ import annotations

import itertools
import math

import pytest

from batchery.engine.config import EngineConfig
from batchery.engine.llm import LLM
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import load_model
from batchery.engine.sampling import MAX_LOGPROBS, SamplingParams

TEXTS = [
    "hello world the cat",
    "once upon a time there was a dog",
    "summarize this text about the sea and the sky",
    "write a story about fire and rain",
]
N = 12  # new tokens per request in most tests
_rid = itertools.count()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loaded):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=512), loaded=loaded)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.encode(t) for t in TEXTS]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": N, **kw})


def sample(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, ignore_eos=True, **{"max_tokens": N, **kw})


def drain(eng: LLMEngine, rids: list[str], outs: dict | None = None) -> list:
    """Step until the engine is empty; each request finishes exactly once; every block comes back."""
    outs = {} if outs is None else outs
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            assert o.finish_reason is not None and o.request_id not in outs, o.request_id
            outs[o.request_id] = o
    else:
        raise AssertionError("engine did not drain")
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], "KV blocks leaked"
    assert st["num_running"] == st["num_waiting"] == 0
    return [outs[r] for r in rids]


def generate(eng: LLMEngine, prompts: list[list[int]], params) -> list:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rids.append(f"r{next(_rid)}")
        eng.add_request(rids[-1], p, sp)
    return drain(eng, rids)


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """Greedy continuations (N tokens) of every prompt, computed as one batch."""
    return [o.token_ids for o in generate(engine, prompts, greedy())]


# -- seeds and temperature ---------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine, prompts, reference):
    p0 = prompts[0]
    sp = sample(seed=1234)
    alone = generate(engine, [p0], sp)[0].token_ids
    assert len(alone) == N
    assert generate(engine, [p0], sample(seed=1234))[0].token_ids == alone
    assert alone != reference[0]  # really sampled

    # same seed amid different companions (greedy, unseeded, other seeds, filters)
    batch = generate(
        engine, [prompts[1], p0, prompts[2], prompts[3]], [sample(), sp, greedy(), sample(seed=7, top_p=0.8, top_k=20)]
    )
    assert batch[1].token_ids == alone

    # same seed joining while others are already decoding (different step composition)
    rids = [f"r{next(_rid)}" for _ in range(3)]
    engine.add_request(rids[0], prompts[1], sample(max_tokens=N + 4))
    engine.add_request(rids[1], prompts[2], sample(seed=99))
    outs: dict = {}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] = o
    engine.add_request(rids[2], p0, sample(seed=1234))
    assert drain(engine, rids, outs)[2].token_ids == alone

    # two requests with the same seed in one batch agree; another seed differs
    twins = generate(engine, [p0, p0, p0], [sample(seed=1234), sample(seed=1234), sample(seed=1235)])
    assert twins[0].token_ids == twins[1].token_ids == alone
    assert twins[2].token_ids != alone


def test_unseeded_sampling_works_and_varies(engine, prompts, reference):
    vocab = engine.runner.vocab_size
    a, b = generate(engine, [prompts[0], prompts[0]], sample())
    c = generate(engine, [prompts[0]], SamplingParams(temperature=0.7, max_tokens=N, ignore_eos=True))[0]
    for o in (a, b, c):
        assert len(o.token_ids) == N and o.finish_reason == "length"
        assert all(0 <= t < vocab for t in o.token_ids)
    assert a.token_ids != b.token_ids
    assert a.token_ids != reference[0] and c.token_ids != reference[0]


def test_temperature_zero_is_greedy_and_batch_independent(engine, prompts, reference):
    alone = [generate(engine, [p], greedy())[0].token_ids for p in prompts[:2]]
    assert alone == reference[:2]


@pytest.mark.parametrize(
    "filt", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k=1", "top_p=tiny", "min_p=1"]
)
def test_filters_that_keep_only_the_argmax_equal_greedy(engine, prompts, reference, filt):
    # high temperature, next to unfiltered sampled companions: only the filter can make it greedy
    params = [SamplingParams(temperature=2.0, max_tokens=N, ignore_eos=True, **filt) for _ in prompts]
    params += [sample() for _ in prompts]
    outs = generate(engine, prompts + prompts, params)
    assert [o.token_ids for o in outs[: len(prompts)]] == reference
    assert [o.token_ids for o in outs[len(prompts) :]] != reference


def test_loose_filters_still_sample(engine, prompts, reference):
    outs = generate(engine, prompts, [sample(top_k=50, top_p=0.95, min_p=0.01, seed=i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] != reference


# -- penalties ---------------------------------------------------------------------------------


def test_greedy_reference_repeats_itself(reference):
    # the premise of the penalty tests: plain greedy on the tiny model loops
    assert any(len(set(r)) < len(r) for r in reference)


@pytest.mark.parametrize(
    "pen",
    [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=-2.0),
    ],
    ids=["repetition", "presence", "frequency", "negative-presence"],
)
def test_penalties_change_greedy_output(engine, prompts, reference, pen):
    outs = generate(engine, prompts, greedy(**pen))
    changed = [o.token_ids != r for o, r in zip(outs, reference)]
    assert any(changed)
    repeating = [i for i, r in enumerate(reference) if len(set(r)) < len(r)]
    assert all(changed[i] for i in repeating)


def test_large_repetition_penalty_never_repeats_a_token(engine, prompts, reference):
    outs = generate(engine, prompts, greedy(repetition_penalty=10.0))
    for o, p in zip(outs, prompts):
        assert len(set(o.token_ids)) == len(o.token_ids), o.token_ids
        assert not set(o.token_ids) & set(p)  # prompt tokens are penalised too


def test_negative_presence_penalty_makes_greedy_repeat(engine, prompts):
    outs = generate(engine, prompts, greedy(presence_penalty=-2.0))
    assert all(len(set(o.token_ids)) < len(o.token_ids) for o in outs)


def test_penalties_of_one_request_do_not_leak_into_its_batch(engine, prompts, reference):
    params = [greedy(repetition_penalty=10.0), greedy(), greedy(frequency_penalty=2.0), greedy()]
    outs = generate(engine, prompts, params)
    assert outs[1].token_ids == reference[1] and outs[3].token_ids == reference[3]


# -- stopping ----------------------------------------------------------------------------------


def _decode(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_max_tokens_gives_length_with_exactly_max_tokens(engine, prompts):
    for m in (1, 2, 7):
        outs = generate(engine, prompts[:2], [greedy(max_tokens=m), sample(max_tokens=m)])
        for o in outs:
            assert o.finish_reason == "length" and len(o.token_ids) == m
            assert o.text == _decode(engine, o.token_ids)


def test_stop_string_is_trimmed_and_finishes_with_stop(engine, prompts, reference):
    full_text = _decode(engine, reference[0])
    words = full_text.split()
    # a two-word stop string (spans two tokens), starting at the 3rd word of the greedy output
    stop = " ".join(words[2:4])
    cut = full_text.find(stop)
    assert cut > 0
    m = next(k for k in range(1, N + 1) if stop in _decode(engine, reference[0][:k]))
    out = generate(engine, [prompts[0]], greedy(stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[0][:m]  # stops on the token that completes the stop string
    assert out.text == full_text[:cut]
    assert stop not in out.text


def test_earliest_of_several_stop_strings_wins(engine, prompts, reference):
    full_text = _decode(engine, reference[1])
    words = full_text.split()
    late, early = words[5], words[1]
    assert full_text.find(early) < full_text.find(late)
    out = generate(engine, [prompts[1]], greedy(stop=[late, "zzz-never", early]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.find(early)]


def test_stop_string_that_never_appears_runs_to_length(engine, prompts, reference):
    out = generate(engine, [prompts[0]], greedy(stop=["not in the vocabulary!"]))[0]
    assert out.finish_reason == "length" and out.token_ids == reference[0]
    assert out.text == _decode(engine, reference[0])


def _first_new(seq: list[int], start: int = 1) -> int:
    """Index of the first token at or after ``start`` that has not appeared before it."""
    return next(k for k in range(start, len(seq)) if seq[k] not in seq[:k])


def test_stop_token_ids_finish_with_stop(engine, prompts, reference):
    k = _first_new(reference[2], 3)
    tok = reference[2][k]
    out = generate(engine, [prompts[2]], greedy(stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[2][: k + 1]  # the stop token is the last token...
    assert out.text == _decode(engine, reference[2][:k])  # ...but not part of the text


def test_min_tokens_suppresses_stop_tokens(engine, prompts, reference):
    tok = reference[0][0]
    stopped = generate(engine, [prompts[0]], greedy(stop_token_ids=[tok]))[0]
    assert stopped.token_ids == [tok] and stopped.finish_reason == "stop"
    out = generate(engine, [prompts[0]], greedy(stop_token_ids=[tok], min_tokens=4, max_tokens=24))[0]
    assert len(out.token_ids) > 4
    assert tok not in out.token_ids[:4]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == tok and tok not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24


@pytest.fixture()
def eos_engine(tiny_model_dir, loaded, reference):
    """A second engine whose EOS set is a token the greedy output really produces (the tiny model
    never emits its own </s> reliably)."""
    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64), loaded=loaded)
    assert eng.eos_ids == [eng.tokenizer.eos_token_id]
    k = _first_new(reference[0], 2)
    eng.eos_ids = [reference[0][k]]
    return eng, k


def test_eos_finishes_with_stop_unless_ignored(eos_engine, prompts, reference):
    eng, k = eos_engine
    eos = eng.eos_ids[0]
    plain = generate(eng, [prompts[0]], SamplingParams(temperature=0, max_tokens=N))[0]
    assert plain.finish_reason == "stop"
    assert plain.token_ids == reference[0][: k + 1] and plain.token_ids[-1] == eos
    assert plain.text == _decode(eng, reference[0][:k])

    ignored = generate(eng, [prompts[0]], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == reference[0]

    held = generate(eng, [prompts[0]], SamplingParams(temperature=0, max_tokens=N, min_tokens=k + 2))[0]
    assert eos not in held.token_ids[: k + 2]
    assert len(held.token_ids) > k + 2
    assert held.finish_reason == "length" or held.token_ids[-1] == eos


# -- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [greedy(logprobs=5), sample(logprobs=5, seed=3), sample(logprobs=MAX_LOGPROBS)],
    ids=["greedy", "seeded", "max"],
)
def test_logprobs_entries(engine, prompts, params):
    n = params.logprobs
    out = generate(engine, [prompts[1]], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == N
    for tok, e in zip(out.token_ids, out.logprobs):
        assert e["token_id"] == tok
        assert e["logprob"] <= 0.0 and math.isfinite(e["logprob"])
        top = e["top"]
        assert len(top) == n and len({t for t, _ in top}) == n
        vals = [lp for _, lp in top]
        assert vals == sorted(vals, reverse=True)
        assert all(v <= 0.0 for v in vals) and sum(math.exp(v) for v in vals) <= 1.0 + 1e-5
        assert top[0][1] >= e["logprob"] - 1e-6
        if tok in dict(top):
            assert dict(top)[tok] == pytest.approx(e["logprob"], abs=1e-6)
        if params.temperature == 0:
            assert top[0][0] == tok


def test_logprobs_zero_and_none(engine, prompts):
    zero, none = generate(engine, [prompts[0], prompts[0]], [greedy(logprobs=0), greedy()])
    assert none.logprobs is None
    assert len(zero.logprobs) == N and all(e["top"] == [] and e["logprob"] <= 0 for e in zero.logprobs)
    assert zero.token_ids == none.token_ids


def test_logprobs_are_the_models_distribution_not_the_filtered_one(engine, prompts):
    plain, filtered = generate(engine, [prompts[0], prompts[0]], [greedy(logprobs=3), greedy(logprobs=3, top_k=1)])
    # temperature 0 ignores top_k, so both follow the same path and report the same distribution
    assert plain.token_ids == filtered.token_ids
    for a, b in zip(plain.logprobs, filtered.logprobs):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    # the model is near-uniform over ~190 tokens: an unfiltered argmax is far from probability 1
    assert all(e["logprob"] < -1.0 for e in plain.logprobs)


# -- abort and blocks --------------------------------------------------------------------------


def test_abort_frees_blocks_and_never_reports_the_request(engine, prompts):
    rids = [f"r{next(_rid)}" for _ in range(3)]
    for rid, p in zip(rids, prompts[1:]):
        engine.add_request(rid, p, greedy(max_tokens=24))
    outs: dict = {}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] = o
    st = engine.stats()
    assert st["num_running"] == 3 and st["kv_blocks_free"] < st["kv_blocks_total"]
    used_by = {r: set(engine.requests[r].block_table) for r in rids}
    assert engine.abort(rids[1]) is True
    assert engine.stats()["kv_blocks_free"] == st["kv_blocks_free"] + len(
        used_by[rids[1]] - used_by[rids[0]] - used_by[rids[2]]
    )
    assert engine.stats()["num_running"] == 2
    assert engine.abort(rids[1]) is False  # already gone
    assert engine.abort("never-added") is False
    outs2 = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.request_id != rids[1]
            outs2[o.request_id] = o
    assert set(outs2) == {rids[0], rids[2]}
    assert all(len(o.token_ids) == 24 for o in outs2.values())
    st = engine.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_abort_a_waiting_request(engine, prompts):
    rid = f"r{next(_rid)}"
    engine.add_request(rid, prompts[0], greedy())
    assert engine.stats()["num_waiting"] == 1
    assert engine.abort(rid) is True
    assert engine.stats()["num_waiting"] == 0 and not engine.has_unfinished()
    assert engine.step() == []
    # the id is free again
    engine.add_request(rid, prompts[0], greedy(max_tokens=2))
    assert [o.request_id for o in drain(engine, [rid])] == [rid]


def test_abort_mid_chunked_prefill_frees_blocks(tiny_model_dir, loaded, prompts):
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=4
        ),
        loaded=loaded,
    )
    long_prompt = prompts[2] + prompts[3] + prompts[1]
    eng.add_request("long", long_prompt, greedy())
    eng.add_request("short", prompts[0], greedy(max_tokens=3))
    eng.step()
    seq = eng.requests["long"]
    assert 0 < seq.num_computed_tokens < len(long_prompt)
    assert eng.abort("long")
    out = drain(eng, ["short"])
    assert out[0].finish_reason == "length"


def test_all_blocks_return_after_many_requests(engine, prompts):
    system = {
        "role": "system",
        "content": "you are a good model . write a long answer to each question "
        "about the city , the sea and the sky please",
    }
    chats = [engine.encode_chat([system, {"role": "user", "content": t}]) for t in TEXTS * 3]
    assert all(len(c) > 2 * engine.config.block_size for c in chats)
    params = [
        greedy(max_tokens=3 + i % 5) if i % 2 else sample(max_tokens=2 + i % 7, seed=i) for i in range(len(chats))
    ]
    generate(engine, chats[:1], params[:1])  # warms the prefix cache with the system prompt
    outs = generate(engine, chats, params)  # generate() asserts the pool is full again
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert all(o.num_cached_tokens >= engine.config.block_size for o in outs)  # the shared system prompt


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("temperature", 101.0),
        ("temperature", float("nan")),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", 11),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", None),
        ("logprobs", 100),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
        ("seed", "abc"),
        ("seed", 1.0),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("min_tokens", -1),
        ("min_tokens", None),
    ],
)
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field,value", [("temperature", "0.5"), ("top_p", None), ("min_p", "x"), ("stop", 5), ("stop_token_ids", 5)]
)
def test_wrongly_typed_sampling_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: value})


def test_valid_edge_values_are_normalised():
    p = SamplingParams(
        top_k=-1,
        stop="x",
        stop_token_ids=None,
        temperature=0,
        top_p=1.0,
        min_p=1.0,
        logprobs=MAX_LOGPROBS,
        max_tokens=1,
    )
    assert p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == [] and p.greedy


# -- rejected prompts --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_engine(tiny_model_dir, loaded):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=32), loaded=loaded)


def test_bad_prompts_are_rejected_while_other_requests_complete(short_engine, prompts):
    eng = short_engine
    assert eng.max_model_len == 32
    eng.add_request("ok", prompts[1], greedy(max_tokens=8))
    eng.step()
    bad = {
        "empty": ([], "empty"),
        "too-long": (list(range(10, 42)), "max_model_len"),  # 32 tokens: no room to generate
        "way-too-long": (list(range(10, 60)) * 2, "max_model_len"),
        "out-of-vocab": ([5, eng.runner.vocab_size], "token ids"),
        "negative": ([-1, 5], "token ids"),
    }
    for rid, (ids, msg) in bad.items():
        with pytest.raises(ValueError, match=msg):
            eng.add_request(rid, ids, greedy())
        assert rid not in eng.requests
    with pytest.raises(ValueError, match="SamplingParams"):
        eng.add_request("not-params", prompts[0], {"max_tokens": 3})
    eng.add_request("ok2", prompts[0], greedy(max_tokens=4))
    outs = drain(eng, ["ok", "ok2"])
    assert [len(o.token_ids) for o in outs] == [8, 4]
    assert all(o.finish_reason == "length" for o in outs)
    # a rejected id was never registered: it can be used for a good request
    eng.add_request("too-long", prompts[0], greedy(max_tokens=2))
    assert drain(eng, ["too-long"])[0].token_ids


def test_context_limit_stops_generation_with_length(short_engine):
    eng = short_engine
    eng.add_request("31", list(range(10, 41)), greedy(max_tokens=16))  # room for exactly one token
    eng.add_request("28", list(range(10, 38)), greedy(max_tokens=16))
    out31, out28 = drain(eng, ["31", "28"])
    assert len(out31.token_ids) == 1 and out31.finish_reason == "length"
    assert len(out28.token_ids) == 4 and out28.finish_reason == "length"


def test_duplicate_request_id_is_rejected(engine, prompts, reference):
    engine.add_request("dup", prompts[0], greedy())
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", prompts[1], greedy())
    out = drain(engine, ["dup"])[0]
    assert out.token_ids == reference[0]  # the original request is unaffected
    engine.add_request("dup", prompts[1], greedy(max_tokens=2))  # finished ids can be reused
    assert drain(engine, ["dup"])[0].token_ids == reference[1][:2]


def test_llm_generate_fails_only_the_too_long_prompt(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=32)
    long_ids = list(range(10, 50))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["hello world the cat", long_ids, "once upon a time", ""], sp)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "error"]
    assert "max_model_len" in outs[1].error and outs[1].token_ids == [] and outs[1].text == ""
    assert "empty" in outs[3].error
    assert outs[0].error is None and len(outs[0].token_ids) == 4
    alone = llm.generate(["hello world the cat", "once upon a time"], sp)
    assert [o.token_ids for o in alone] == [outs[0].token_ids, outs[2].token_ids]
    assert outs[1].prompt_token_ids == long_ids
    assert not llm.engine.has_unfinished()


# -- prefix cache correctness ------------------------------------------------------------------


def test_prefix_cache_never_serves_kv_of_another_prefix(tiny_model_dir, loaded, engine):
    cfg = dict(model=str(tiny_model_dir), dtype="float32", block_size=4, num_kv_blocks=64)
    eng = LLMEngine(EngineConfig(**cfg), loaded=loaded)
    prompt = engine.encode("hello world the cat is on the sea")  # 8 tokens: two full blocks
    assert len(prompt) == 8
    sp = greedy(max_tokens=8, logprobs=0)
    first = generate(eng, [prompt], sp)[0]
    again = generate(eng, [prompt], sp)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 4
    probe = again.token_ids[:4] + [prompt[0]]  # a new prompt that starts with generated tokens
    got = generate(eng, [probe], sp)[0]
    ref = generate(LLMEngine(EngineConfig(**cfg, enable_prefix_caching=False), loaded=loaded), [probe], sp)[0]
    assert got.num_cached_tokens == 0
    assert got.token_ids == ref.token_ids
    assert [e["logprob"] for e in got.logprobs] == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-4)
