"""Acceptance 1-2 of the engine: greedy fp32 on the real SmolLM2-135M-Instruct matches Hugging Face
``generate`` run on each prompt alone, token for token, also under chunked prefill, preemption
and prefix-cache hits."""

from __future__ import annotations

import pytest
from engine_util import CHAT_PROMPTS, hf_greedy

from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import load_model
from batchery.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # the real SmolLM2 model
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm():
    return load_model(EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def prompts(smollm):
    eng = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=8), loaded=smollm)
    return [eng.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm, prompts):
    # min_new_tokens bans EOS in HF; the engine's min_tokens does the same.
    return [hf_greedy(smollm, p, NEW_TOKENS) for p in prompts]


def run_engine(loaded, prompts, warm_first: bool = False, **kw):
    eng = LLMEngine(EngineConfig(dtype="float32", **kw), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = {}
    start = 0
    if warm_first:  # compute one prompt first so the shared template blocks are in the prefix cache
        eng.add_request("0", prompts[0], params)
        while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
            for o in eng.step():
                outs[o.request_id] = o
        start = 1
    for i, p in enumerate(prompts[start:], start):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert eng.stats()["kv_blocks_free"] == eng.num_kv_blocks, "blocks leaked"
    return eng, [outs[str(i)] for i in range(len(prompts))]


def assert_identical(outs, reference):
    mismatched = [i for i, (o, r) in enumerate(zip(outs, reference)) if o.token_ids != r]
    assert not mismatched, f"prompts {mismatched} differ from HF generate"
    assert all(len(o.token_ids) == NEW_TOKENS and o.finish_reason == "length" for o in outs)


def test_batched_greedy_matches_hf(smollm, prompts, reference):
    eng, outs = run_engine(smollm, prompts)
    assert_identical(outs, reference)
    assert eng.stats()["mean_batch_size"] > 8  # they really ran together


def test_chunked_prefill_matches_hf(smollm, prompts, reference):
    eng, outs = run_engine(smollm, prompts, max_num_batched_tokens=24)
    assert_identical(outs, reference)
    assert max(len(p) for p in prompts) > 24  # chunking really happened


def test_preemption_matches_hf(smollm, prompts, reference):
    eng, outs = run_engine(smollm, prompts, num_kv_blocks=40, block_size=16)
    assert_identical(outs, reference)
    assert eng.stats()["num_preemptions"] > 0


def test_prefix_cache_hits_match_hf(smollm, prompts, reference):
    eng, outs = run_engine(smollm, prompts, warm_first=True)
    assert_identical(outs, reference)
    st = eng.stats()
    assert st["prefix_cache_hit_tokens"] >= 16 * (len(prompts) - 1)
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
