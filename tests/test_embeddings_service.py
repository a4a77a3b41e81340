"""The engine service running a pooling engine (issue 38): an embeddings request is one engine request whatever its
number of inputs; a request of the other kind is refused at once naming the model's kind; a failed step fails its
requests with a retryable error, the engine is rebuilt (its canary runs on the pooling engine) and serves again;
a poison input is quarantined and fails alone, the other requests unharmed."""

from __future__ import annotations

import pytest

from batchery.contract.errors import EngineCrash, EngineFailure, InvalidRequest
from batchery.contract.generation import GenerationRequest
from batchery.contract.names import EMBEDDING_MODEL
from batchery.engine.config import EngineConfig
from batchery.worker.service import EngineService
from batchery.worker.service.faults import parse_faults

pytestmark = pytest.mark.slow


@pytest.fixture()
def service():
    services = []

    def make(faults: str = "") -> EngineService:
        config = EngineConfig(model=EMBEDDING_MODEL, dtype="float32", device="cpu")
        s = EngineService(config, faults=parse_faults(faults), rebuild_backoff=0.05, solo_attempts=1)
        s.start()
        services.append(s)
        return s

    yield make
    for s in services:
        s.stop()


def embed(*texts: str, **pooling) -> GenerationRequest:
    return GenerationRequest(inputs=list(texts), pooling=pooling)


def test_embeddings_through_the_service(service):
    s = service()
    r = s.generate(embed("one", "two words", "one"), timeout=60)
    assert r.embeddings is not None and len(r.embeddings) == 3 and len(r.embeddings[0]) == 384
    assert r.embeddings[0] == r.embeddings[2] and r.num_prompt_tokens == 3 + 4 + 3
    assert s.engine_stats["num_pooled_inputs"] == 3 and s.num_kv_blocks == 0
    with pytest.raises(InvalidRequest, match="an embedding model: it takes /v1/embeddings requests only"):
        s.generate(GenerationRequest(messages=[{"role": "user", "content": "hi"}]), timeout=60)
    with pytest.raises(InvalidRequest, match=r"input\[1\] has 402 tokens"):
        s.generate(embed("fine", "word " * 400), timeout=60)
    assert len(s.generate(embed("word " * 400, truncate_prompt_tokens=-1), timeout=60).embeddings[0]) == 384


def test_a_failed_step_is_retryable_and_the_engine_comes_back(service):
    s = service("step_raise:1")
    with pytest.raises(EngineFailure):
        s.generate(embed("the first step fails"), timeout=60)
    r = s.generate(embed("after the rebuild"), timeout=60)
    assert r.embeddings is not None and s.num_rebuilds == 1


def test_a_poison_input_fails_alone(service):
    s = service("poison:POISON")
    with pytest.raises(EngineFailure):
        s.generate(embed("fine", "POISON here"), timeout=60)
    with pytest.raises(EngineCrash):  # quarantined: alone, it fails again: poison
        s.generate(GenerationRequest(inputs=["fine", "POISON here"], solo=True), timeout=60)
    assert s.generate(embed("unharmed"), timeout=60).embeddings is not None
