"""``SamplingParams.logit_bias`` (OpenAI's: a token id -> a bias in [-100, 100] added to its logit)
on the tiny random Llama, whose next-token distribution is close to uniform over ~190 tokens: a
bias of +100 forces a token, -100 bans it, and a moderate one shows in the samples.

The bias is added to the raw logits, before penalties, temperature and the filters, one row's bias
never reaches another row, and logprobs stay those of the model's distribution. Token ids outside
the vocabulary and out-of-range biases are refused with a message naming them."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from batchery.engine.config import EngineConfig
from batchery.engine.llm import LLM
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import load_model
from batchery.engine.sampling import MAX_LOGIT_BIAS, SamplingParams

TEXTS = ["hello world the cat", "once upon a time there was a dog", "write a story about fire and rain"]
N = 12
_rid = itertools.count()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loaded):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256), loaded=loaded)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.encode(t) for t in TEXTS]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": N, **kw})


def sample(seed: int, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, ignore_eos=True, **{"max_tokens": N, "temperature": 1.0, **kw})


def generate(eng: LLMEngine, prompts: list[list[int]], params) -> list:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rids.append(f"b{next(_rid)}")
        eng.add_request(rids[-1], p, sp)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return [outs[r] for r in rids]


@pytest.fixture(scope="module")
def reference(engine, prompts):
    return [o.token_ids for o in generate(engine, prompts, greedy())]


def word(engine, w: str) -> int:
    (tok,) = engine.encode(w)
    return tok


@pytest.fixture(scope="module")
def rare(engine, prompts, reference) -> int:
    """An ordinary word token that neither the prompts nor their greedy outputs contain."""
    seen = {t for r in reference + prompts for t in r}
    words = ("banana", "river", "mountain", "paper", "stone", "snow")
    return next(t for w in words if (t := word(engine, w)) not in seen)


def test_plus_100_forces_a_token_greedy_and_sampled(engine, prompts, reference, rare):
    cat = rare
    outs = generate(engine, prompts, [greedy(logit_bias={cat: 100}), sample(1, logit_bias={cat: 100.0}), greedy()])
    assert outs[0].token_ids == [cat] * N
    assert outs[1].token_ids == [cat] * N
    assert outs[2].token_ids == reference[2]  # the unbiased row beside them is untouched


def test_minus_100_bans_tokens(engine, prompts, reference):
    banned = set(reference[0])
    out = generate(engine, prompts[:1], greedy(logit_bias={t: -100.0 for t in banned}))[0]
    assert len(out.token_ids) == N and not banned & set(out.token_ids)
    keep = {word(engine, "dog"), word(engine, "cat")}
    ban = dict.fromkeys(set(range(engine.runner.vocab_size)) - keep, -100)  # the whole vocabulary but two
    assert len(ban) <= MAX_LOGIT_BIAS
    outs = generate(engine, prompts[:1] * 2, [sample(s, logit_bias=ban) for s in (1, 2)])
    seen = {t for o in outs for t in o.token_ids}
    assert seen == keep  # sampling between the two kept ones, nearly evenly


def test_a_moderate_bias_shifts_the_samples(engine, prompts):
    dog = word(engine, "dog")
    params = [sample(s, max_tokens=16) for s in range(4)]
    plain = Counter(t for o in generate(engine, [prompts[1]] * 4, params) for t in o.token_ids)
    biased = [sample(s, max_tokens=16, logit_bias={dog: 5}) for s in range(4)]
    pushed = Counter(t for o in generate(engine, [prompts[1]] * 4, biased) for t in o.token_ids)
    # e^5 ~ 148 against ~190 near-equal tokens: about 40% of 64 samples, against ~0.5% unbiased
    assert pushed[dog] >= 12 > plain[dog] + 4


def test_the_bias_comes_before_temperature(engine, prompts):
    cat = word(engine, "cat")
    # (logit + 100) / 100 is only ~1 above the others: at temperature 100 +100 is a nudge, not a force
    hot = generate(engine, [prompts[0]] * 2, [sample(s, temperature=100.0, logit_bias={cat: 100}) for s in (1, 2)])
    count = sum(o.token_ids.count(cat) for o in hot)
    assert count < N  # of 2 * N samples; a bias added after the temperature would give all 2 * N
    assert generate(engine, prompts[:1], sample(3, temperature=2.0, logit_bias={cat: 100}))[0].token_ids == [cat] * N


def test_the_bias_comes_before_penalties(engine, prompts):
    hello = word(engine, "hello")  # in prompts[0], so the repetition penalty acts on it
    assert hello in prompts[0]
    first = lambda **kw: generate(engine, prompts[:1], greedy(max_tokens=1, **kw))[0].token_ids[0]  # noqa: E731
    # the raw logits lie within about +-0.4: +1 makes "hello" the argmax ...
    assert first(logit_bias={hello: 1.0}) == hello
    # ... but a penalty of 10 divides the biased logit, (l + 1) / 10 ~ 0.1, below the best unpenalised
    # tokens (a bias added after the penalty, l / 10 + 1, would still win)
    assert first(logit_bias={hello: 1.0}, repetition_penalty=10.0) != hello
    assert first(logit_bias={hello: 100.0}, repetition_penalty=10.0) == hello


def test_logprobs_stay_the_models(engine, prompts, reference, rare):
    forced = rare
    plain, biased = generate(
        engine, prompts[1:2] * 2, [greedy(logprobs=20), greedy(logprobs=20, logit_bias={forced: 100})]
    )
    assert biased.token_ids == [forced] * N
    assert all(e["token_id"] == forced and e["logprob"] < -2.0 for e in biased.logprobs)  # not ~0
    # the first step has the same context, so the same distribution whatever the bias
    b_top, p_top = biased.logprobs[0]["top"], plain.logprobs[0]["top"]
    assert [t for t, _ in b_top] == [t for t, _ in p_top]
    assert [lp for _, lp in b_top] == pytest.approx([lp for _, lp in p_top], abs=1e-6)
    assert plain.logprobs[0]["top"][0][0] != forced
    raw = dict(plain.logprobs[0]["top"])
    if forced in raw:
        assert biased.logprobs[0]["logprob"] == pytest.approx(raw[forced], abs=1e-6)


def test_biases_with_other_rows_and_filters(engine, prompts, reference):
    cat, dog = word(engine, "cat"), word(engine, "dog")
    outs = generate(
        engine,
        prompts + prompts[:1],
        [
            greedy(logit_bias={dog: 100, cat: -100}),
            greedy(),
            sample(4, top_k=5, logit_bias={cat: 100}),
            greedy(logit_bias={reference[0][0]: -100}),
        ],
    )
    assert outs[0].token_ids == [dog] * N
    assert outs[1].token_ids == reference[1]
    assert outs[2].token_ids == [cat] * N  # the biased token is the top-1 after the bias
    assert outs[3].token_ids[0] != reference[0][0]


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 100.5}, r"logit_bias\[5\] must be a number in \[-100, 100\], got 100.5"),
        ({5: -101}, r"logit_bias\[5\] must be a number in \[-100, 100\], got -101"),
        ({5: float("nan")}, r"logit_bias\[5\] must be a number"),
        ({5: float("inf")}, r"logit_bias\[5\] must be a number"),
        ({5: True}, r"logit_bias\[5\] must be a number"),
        ({5: "1"}, r"logit_bias\[5\] must be a number"),
        ({"5": 1.0}, "logit_bias keys must be non-negative integer token ids, got '5'"),
        ({-1: 1.0}, "logit_bias keys must be non-negative integer token ids, got -1"),
        (dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0), f"has {MAX_LOGIT_BIAS + 1} entries, more than the 1024"),
        ([5, 1.0], "logit_bias must be a dict"),
    ],
)
def test_invalid_biases_are_refused_naming_the_field(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_edge_biases_are_accepted():
    p = SamplingParams(logit_bias={7: -100, 3: 100.0, 5: 0})
    assert p.logit_bias_items == ([3, 5, 7], [100.0, 0.0, -100.0])
    assert SamplingParams(logit_bias={}).logit_bias_items == ([], [])
    assert SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS), 1)).logit_bias_items[0][-1] == 1023


def test_token_ids_outside_the_vocabulary_are_refused(engine, prompts, reference):
    vocab = engine.runner.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids {vocab}, {vocab + 7} .*vocabulary of {vocab}"):
        engine.add_request("oov", prompts[0], greedy(logit_bias={vocab + 7: 1.0, 3: 1.0, vocab: -1.0}))
    assert not engine.has_unfinished()
    assert generate(engine, prompts[:1], greedy(logit_bias={vocab - 1: 0.0}))[0].token_ids == reference[0]


def test_llm_generate_fails_only_the_request_with_a_bad_token_id(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    vocab = llm.engine.runner.vocab_size
    outs = llm.generate(["hello world", "the cat"], [greedy(logit_bias={vocab: 5.0}), greedy(max_tokens=3)])
    assert outs[0].finish_reason == "error" and f"vocabulary of {vocab}" in (outs[0].error or "")
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 3
