"""The engine's pooling path on the real all-MiniLM-L6-v2 (issue 38): vectors against sentence-transformers'
``encode`` (same weights), the same input alone and in a full step, packing under the token budget, Matryoshka
``dimensions``, a decoder used as an embedder, and the inputs it must refuse."""

from __future__ import annotations

import json
import random
from collections import deque

import pytest
import torch

from batchery.contract.names import EMBEDDING_MODEL
from batchery.engine.llm import LLM
from batchery.engine.loader import hf_model_dir
from batchery.engine.pooling import PoolingParams
from batchery.engine.pooling_engine import PoolingInput, schedule

pytestmark = pytest.mark.slow

WORDS = (
    "the quick brown fox jumps over lazy dog river mountain café naïve über straße 東京 日本語 데이터 🙂 "
    "batch inference queue worker embedding vector search corpus retrieval chunk document"
).split()


def _texts(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths (1 to about 240 tokens), unicode, leading/trailing spaces, and some inputs twice."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        if out and rng.random() < 0.1:
            out.append(rng.choice(out))  # identical inputs in one batch
            continue
        words = [rng.choice(WORDS) for _ in range(rng.choice([1, 2, 5, 20, 60, 120, 150]))]
        text = " ".join(words)
        if rng.random() < 0.3:
            text = "  " + text + " \t"
        out.append(text)
    return out


@pytest.fixture(scope="module")
def model_dir():
    return hf_model_dir(EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def reference(model_dir):
    from sentence_transformers import SentenceTransformer  # the test extra's reference

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def llm32():
    return LLM(EMBEDDING_MODEL, dtype="float32", device="cpu")


def _vectors(outs) -> torch.Tensor:
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return torch.tensor([o.embedding for o in outs])


def test_matches_sentence_transformers_fp32(llm32, reference):
    texts = _texts(200)
    lens = [len(llm32.engine.encode(t)) for t in texts]
    assert min(lens) <= 3 and 200 <= max(lens) <= 256  # 1 to about 250 tokens
    ours = _vectors(llm32.embed(texts))
    ref = torch.from_numpy(reference.encode(texts, batch_size=32)).float()
    cos = torch.nn.functional.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.99999, cos.min().item()
    norms = ours.norm(dim=-1)
    assert (norms - 1).abs().max().item() <= 1e-5
    assert llm32.engine.num_steps < 200 / 4  # many inputs to a step


def test_matches_sentence_transformers_bf16(reference):
    llm = LLM(EMBEDDING_MODEL, dtype="bfloat16", device="cpu")
    texts = _texts(200, seed=1)
    ours = _vectors(llm.embed(texts))
    ref = torch.from_numpy(reference.encode(texts)).float()
    cos = torch.nn.functional.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.999, cos.min().item()


def test_alone_equals_in_a_full_step(llm32):
    texts = _texts(64, seed=2)
    steps = llm32.engine.num_steps
    full = llm32.embed(texts)
    assert llm32.engine.num_steps - steps <= 64 // 8  # they did share steps
    for i in (0, 7, 33, 63):
        alone = llm32.embed(texts[i])[0]
        assert alone.embedding == full[i].embedding, i  # bit for bit (fp32)


def test_bf16_alone_equals_in_a_full_step_and_the_cpu_kernel_attends(monkeypatch):
    """bf16 too: our linears' sums and the attention kernel's rows never depend on the step, so an input gives the
    same bits alone and packed. Where the CPU prefill kernel is built (AVX-512) every layer's attention of a step is
    one call of it (``cpu_prefill.segment_attention``), not a silent fallback to SDPA per input."""
    from batchery.engine.attention import cpu_prefill

    calls: list[int] = []
    real = cpu_prefill.segment_attention

    def counted(q, k, v, out, seqs, scale, causal):
        calls.append(seqs.shape[0])
        assert not causal  # an encoder attends both ways
        return real(q, k, v, out, seqs, scale, causal)

    monkeypatch.setattr(cpu_prefill, "segment_attention", counted)
    llm = LLM(EMBEDDING_MODEL, dtype="bfloat16", device="cpu")
    texts = _texts(48, seed=4)
    full = llm.embed(texts)
    for i in (0, 21, 47):
        assert llm.embed(texts[i])[0].embedding == full[i].embedding, i
    if cpu_prefill.available():
        layers = llm.engine.runner.loaded.hf_config.num_hidden_layers
        assert len(calls) == layers * llm.engine.num_steps and max(calls) > 1
    else:
        assert calls == []


def test_token_ids_and_text_agree(llm32):
    text = "Embeddings from token ids"
    ids = llm32.engine.encode(text)
    by_text, by_ids = llm32.embed([text, ids])
    assert by_text.embedding == by_ids.embedding and by_text.prompt_token_ids == ids


def test_batch_tokenizing_gives_each_texts_own_ids(llm32):
    """``LLM.embed`` tokenizes its texts in one batch call (``encode_many``): the ids ``encode`` gives one by one, in
    order, with token-id inputs and empty strings (which fail alone) between them."""
    engine = llm32.engine
    texts = [*_texts(40, seed=9), "  leading and trailing  ", "naïve café 東京 🙂", " ".join(["word"] * 200)]
    # as the model's tokenizer.json leaves the fast tokenizer's backend when loaded: padded and truncated to 128
    engine.tokenizer.backend_tokenizer.enable_padding(length=128)
    engine.tokenizer.backend_tokenizer.enable_truncation(128)
    assert engine.encode_many(texts) == [engine.encode(t) for t in texts] and engine.encode_many([]) == []
    mixed = [texts[0], engine.encode(texts[1]), "", texts[2]]
    outs = llm32.embed(mixed)
    assert [o.prompt_token_ids for o in outs] == [
        engine.encode(texts[0]),
        engine.encode(texts[1]),
        [],
        engine.encode(texts[2]),
    ]
    assert outs[2].error and all(o.error is None for i, o in enumerate(outs) if i != 2)


def test_refusals_fail_alone(llm32):
    long = "word " * 400
    outs = llm32.embed(["fine", "", long, [], "also fine"], PoolingParams())
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert outs[1].error == "input is empty" and outs[3].error == "input is empty"
    assert outs[2].error is not None and outs[2].error.startswith("input has 402 tokens; this model takes at most 256")
    assert outs[0].embedding == llm32.embed("fine")[0].embedding
    cut = llm32.embed(long, PoolingParams(truncate_prompt_tokens=256))[0]
    assert cut.error is None and cut.num_prompt_tokens == 256 and cut.prompt_token_ids[-1] == 102  # [SEP] kept
    short = llm32.embed(long, PoolingParams(truncate_prompt_tokens=10))[0]
    assert short.num_prompt_tokens == 10
    bad = llm32.embed("x", PoolingParams(dimensions=128))[0]
    assert bad.error is not None and "does not support dimensions" in bad.error
    assert llm32.embed("x", PoolingParams(dimensions=384))[0].error is None  # its own size is no cut
    with pytest.raises(ValueError, match="embedding model"):
        llm32.generate("hello")


def _req(i: int, n: int, isolated: bool = False) -> PoolingInput:
    return PoolingInput(f"r{i}", 0, [1] * n, isolated)


def test_schedule_packs_under_the_budget():
    waiting = deque([_req(0, 300), _req(1, 500), _req(2, 400), _req(3, 100), _req(4, 2000), _req(5, 50)])
    step = schedule(waiting, max_num_seqs=8, max_num_batched_tokens=1024)
    # 300 + 500 fit; 400 does not (224 left), 100 and 50 behind it go now; 2000 waits for a step of its own
    assert [r.request_id for r in step] == ["r0", "r1", "r3", "r5"]
    assert [r.request_id for r in waiting] == ["r2", "r4"]
    assert [r.request_id for r in schedule(waiting, 8, 1024)] == ["r2"]
    assert [r.request_id for r in schedule(waiting, 8, 1024)] == ["r4"]  # larger than the budget: alone
    waiting = deque(_req(i, 1) for i in range(10))
    assert len(schedule(waiting, max_num_seqs=4, max_num_batched_tokens=1024)) == 4 and len(waiting) == 6
    # a quarantined (isolated) request's inputs run in steps of their own
    waiting = deque([_req(0, 5), _req(1, 5, isolated=True), _req(2, 5)])
    assert [r.request_id for r in schedule(waiting, 8, 1024)] == ["r0", "r2"]
    assert [r.request_id for r in schedule(waiting, 8, 1024)] == ["r1"]


def test_a_request_of_several_inputs(llm32):
    """One request, several inputs (an embeddings body): it finishes when all are pooled; a bad input names its
    index and refuses the whole request, leaving nothing queued."""
    engine = llm32.engine
    texts = ["first input", "second, longer input " * 20, "third"]
    engine.add_request("multi", [engine.encode(t) for t in texts], PoolingParams())
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["multi"] and len(outs[0].outputs) == 3
    assert [o.embedding for o in outs[0].outputs] == [o.embedding for o in llm32.embed(texts)]
    assert outs[0].num_prompt_tokens == sum(len(engine.encode(t)) for t in texts)
    with pytest.raises(ValueError, match=r"input\[1\] has 402 tokens; this model takes at most 256"):
        engine.add_request("bad", [engine.encode("ok"), engine.encode("word " * 400)], PoolingParams())
    assert not engine.has_unfinished() and "bad" not in engine.requests
    engine.add_request("gone", [engine.encode("a"), engine.encode("b")], PoolingParams())
    assert engine.abort("gone") and not engine.has_unfinished() and not engine.abort("gone")


def _tiny_bert_dir(tmp_path, model_dir):
    """A random-weight 2-layer BERT with MiniLM's tokenizer, CLS pooling and Matryoshka dimensions."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    BertModel(cfg).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"matryoshka_dimensions": [64, 32, 16]}))
    return tmp_path


def test_matryoshka_dimensions_and_cls(tmp_path, model_dir, reference):
    d = _tiny_bert_dir(tmp_path, model_dir)
    llm = LLM(str(d), dtype="float32", device="cpu")
    assert llm.engine.pooler.method == "cls" and llm.engine.pooler.matryoshka_dims == (16, 32, 64)
    full = torch.tensor(llm.embed("a matryoshka doll")[0].embedding)
    cut = torch.tensor(llm.embed("a matryoshka doll", PoolingParams(dimensions=16))[0].embedding)
    assert cut.shape == (16,)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:16], dim=0))
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(d), device="cpu")
    ref = torch.from_numpy(st.encode(["a matryoshka doll"]))[0]
    assert torch.nn.functional.cosine_similarity(full, ref, dim=0).item() >= 0.99999
    assert llm.embed("x", PoolingParams(dimensions=65))[0].error is not None


def test_decoder_as_embedder(tiny_model_dir):
    """A causal LM run as an embedder (vLLM's runner=pooling): last-token pooling, causal attention, the
    vector the model's own forward gives for the input alone."""
    from transformers import AutoModel

    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", runner="pooling")
    assert llm.engine.pooler.method == "last" and llm.engine.loaded.is_causal
    texts = ["hello world", "the cat and the dog", "a"]
    ours = _vectors(llm.embed(texts))
    base = AutoModel.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    for i, t in enumerate(texts):
        ids = torch.tensor([llm.engine.encode(t)])
        with torch.no_grad():
            h = base(input_ids=ids).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(h, dim=0)
        assert torch.nn.functional.cosine_similarity(ours[i], ref, dim=0).item() >= 0.99999
