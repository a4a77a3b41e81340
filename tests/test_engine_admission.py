"""Everything the engine will index is checked when a request is admitted (issue 13, item 1).

A request that passes the contract's schemas but not the loaded model (stop token ids beyond the
vocabulary) fails alone, as invalid, at ``add_request``, and the other requests of the same call
complete; a ``top_k`` above the vocabulary means the whole vocabulary. A property test drives random
schema-valid parameters and random prompts through the engine: ``step()`` never raises."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from batchery.contract.generation import GenerationRequest
from batchery.contract.schemas import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SEED_MAX, CompletionRequest
from batchery.engine.config import EngineConfig
from batchery.engine.llm import LLM
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import load_model
from batchery.engine.sampling import SamplingParams
from batchery.worker.service.intake import EngineInput, engine_input

_rid = itertools.count()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loaded):
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_model_len=256), loaded=loaded
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir, engine):
    llm = LLM.__new__(LLM)  # the offline API over the module's engine (no second model load)
    llm.engine, llm.tokenizer, llm._ids = engine, engine.tokenizer, itertools.count()
    return llm


def drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_stop_token_ids_beyond_the_vocabulary_fail_that_request_alone(llm, engine):
    vocab = engine.runner.vocab_size
    good = SamplingParams(max_tokens=4, temperature=0)
    bad = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[vocab + 128009])
    outs = llm.generate(["hello world", "the cat", "the dog"], [good, bad, good])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "stop_token_ids" in outs[1].error and str(vocab) in outs[1].error
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("bad", [[-1], "vocab", [1, 2.0], [1, None], ["3"]])
def test_a_prompt_token_beyond_the_vocabulary_or_not_an_integer_is_refused_by_name(engine, bad):
    vocab = engine.runner.vocab_size
    ids = [5, vocab, 7] if bad == "vocab" else [5, *bad]
    with pytest.raises(ValueError, match=rf"prompt token ids must be integers in \[0, {vocab}\)"):
        engine.add_request("bad-ids", ids, SamplingParams(max_tokens=1))
    engine.add_request("good-ids", [5, vocab - 1, 0, True], SamplingParams(max_tokens=1))  # bool is an int
    assert [o.request_id for o in drain(engine)] == ["good-ids"]


@pytest.mark.parametrize("top_k", [2**63 + 5, 10**30])
def test_top_k_above_the_vocabulary_means_the_whole_vocabulary(llm, engine, top_k):
    huge = SamplingParams(max_tokens=5, temperature=0.8, top_k=top_k, seed=3, ignore_eos=True)
    whole = SamplingParams(max_tokens=5, temperature=0.8, top_k=0, seed=3, ignore_eos=True)
    a, b = llm.generate(["the cat and the sea", "the cat and the sea"], [huge, whole])
    assert a.finish_reason == "length" and a.token_ids == b.token_ids
    assert huge.top_k == top_k  # the caller's params are not rewritten


# -- defence in depth: nothing that passes the schemas fails a step ---------------------------------
def bodies(vocab: int):
    big_id = st.integers(min_value=0, max_value=vocab * 4 + 200_000)
    return st.fixed_dictionaries(
        {"prompt": st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), st.text(max_size=80))},
        optional={
            "max_tokens": st.integers(1, 12),
            "temperature": st.floats(0.0, 2.0),
            "top_p": st.floats(0.01, 1.0),
            "top_k": st.one_of(st.integers(-1, vocab + 5), st.integers(vocab, 2**80)),
            "min_p": st.floats(0.0, 1.0),
            "seed": st.integers(0, SEED_MAX),
            "presence_penalty": st.floats(-2.0, 2.0),
            "frequency_penalty": st.floats(-2.0, 2.0),
            "repetition_penalty": st.floats(0.01, 10.0),
            "stop_token_ids": st.lists(big_id, max_size=MAX_STOP_TOKEN_IDS),
            "min_tokens": st.integers(0, 20),
            "ignore_eos": st.booleans(),
            "logprobs": st.integers(0, MAX_TOP_LOGPROBS),
            "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4),
        },
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_schema_valid_request_fails_a_step(engine, data):
    vocab = engine.runner.vocab_size
    batch = data.draw(st.lists(bodies(vocab), min_size=1, max_size=4))
    added = []
    for body in batch:
        try:
            req = CompletionRequest.model_validate(body)  # only what the schemas accept gets this far
        except ValidationError:
            continue
        prompt = req.prompt
        gen = (
            GenerationRequest(prompt=prompt, sampling=req.sampling())
            if isinstance(prompt, str)
            else GenerationRequest(prompt_token_ids=list(prompt), sampling=req.sampling())
        )
        inp = engine_input(engine, gen)
        if not isinstance(inp, EngineInput):
            continue  # refused at admission, alone, as invalid: what the property allows
        rid = f"prop-{next(_rid)}"
        try:
            engine.add_request(rid, inp.prompt_token_ids, inp.params)
        except ValueError:
            continue
        added.append(rid)
    finished = {o.request_id for o in drain(engine)}  # step() must never raise
    assert set(added) <= finished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
