"""Issue 14 through the worker: structured outputs, n > 1, tools, logit_bias and /v1/responses.

First the engine service in-process on the tiny model (constraints compiled in the caller's thread,
an invalid one refused before any step, choices in the result); then a real worker on the real
SmolLM2 (its byte-level tokenizer is what JSON constraints need), driven through the ``Client`` and
a batch job."""

from __future__ import annotations

import pytest

from batchery.contract.errors import InvalidRequest
from batchery.engine.config import EngineConfig
from batchery.worker.service import EngineService, GenerationRequest


# -- the engine service, in-process, on the tiny model ------------------------------------------------
@pytest.fixture(scope="module")
def service(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_num_seqs=16, num_kv_blocks=256, max_model_len=1024
    )
    s = EngineService(config, rebuild_backoff=0.05)
    s.start()
    yield s
    s.stop()


def chat(**sampling) -> GenerationRequest:
    return GenerationRequest(
        messages=[{"role": "user", "content": "hello world"}], sampling={"max_tokens": 8, **sampling}
    )


def grammars(s: EngineService):
    return s._shared.engine.grammars


@pytest.mark.parametrize(
    "constraint, needle",
    [
        ({"json": {"type": "nonsense"}}, "invalid json constraint"),
        ({"regex": "(("}, "invalid regex constraint"),
        ({"grammar": "root ::= "}, "invalid grammar constraint"),
        ({"json": {"type": "string"}, "regex": "a"}, "exactly one"),
        ({"jsn": {}}, "unknown field"),
        ("json", "must be an object"),
    ],
)
def test_an_invalid_constraint_is_refused_at_submit_before_any_step(service, constraint, needle):
    steps, struck = service.stats()["num_steps"], service.num_struck
    with pytest.raises(InvalidRequest, match=needle):
        service.submit(chat(structured_outputs=constraint))  # raised here, not on a future
    assert service.stats()["num_steps"] == steps and service.num_struck == struck
    assert service.health()["num_pending"] == 0
    assert service.generate(chat(), 30).token_ids  # the engine goes on


def test_a_constraint_is_compiled_in_the_callers_thread(service):
    before = grammars(service).num_compiled
    spec = {"choice": ["yes", "no"]}  # whole words: the tiny tokenizer has no spaces inside its tokens
    _rid, fut = service.submit(chat(structured_outputs=spec, temperature=1.0, seed=5))
    assert grammars(service).num_compiled == before + 1  # done before the loop saw the request
    r = fut.result(timeout=30)
    assert r.text in spec["choice"] and r.finish_reason == "stop"
    hits = grammars(service).num_hits
    assert service.generate(chat(structured_outputs=spec), 30).text in spec["choice"]
    assert grammars(service).num_compiled == before + 1 and grammars(service).num_hits > hits  # cached


def test_n_choices_in_the_result(service):
    r = service.generate(chat(n=3, temperature=1.0, seed=11, ignore_eos=True, logprobs=1), 30)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in r.choices)
    assert all(len(c.logprobs) == 8 and c.logprobs[0]["token_id"] == c.token_ids[0] for c in r.choices)
    first = r.choices[0]
    assert (r.text, r.token_ids, r.finish_reason, r.logprobs) == (
        first.text,
        first.token_ids,
        first.finish_reason,
        first.logprobs,
    )
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # each choice its own stream
    one = service.generate(chat(temperature=1.0, seed=11, ignore_eos=True), 30)
    assert len(one.choices) == 1 and one.choices[0].token_ids == one.token_ids
