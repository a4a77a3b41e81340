"""The bf16 BERT encoder on the CPU kernels (``engine/fused_bert.py``) and the kernels it adds: ``linear_bf16_into``
(a linear into a caller's buffer, GELU in its epilogue) and ``fused_add_layer_norm``. The real all-MiniLM-L6-v2 against
sentence-transformers is in test_embeddings_engine.py; here random-weight BERTs from transformers configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchery.engine import cpu_kernels, fused_bert
from batchery.engine.attention import cpu_prefill

kernels = cpu_kernels.load()
needs_bf16_tiles = pytest.mark.skipif(
    kernels is None or not kernels.has_bf16_silu() or not cpu_prefill.available(),
    reason="the CPU kernels' AVX512-BF16 tiles are not built here",
)


@needs_bf16_tiles
@pytest.mark.parametrize("rows", [1, 7, 64, 301])
def test_linear_into_is_linear_bf16_and_with_gelu_linear_then_fused_gelu(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96).bfloat16()
    w = (torch.randn(160, 96) / 10).bfloat16()
    b = torch.randn(160).bfloat16()
    wp = kernels.pack_bf16(w)
    plain = kernels.linear_bf16(x, wp, 160, b)
    out = torch.full((rows, 160), float("nan"), dtype=torch.bfloat16)
    assert kernels.linear_bf16_into(x, wp, 160, b, out, False) is not None
    assert torch.equal(out, plain)
    kernels.linear_bf16_into(x, wp, 160, b, out, True)
    assert torch.equal(out, kernels.fused_gelu(plain.clone()))
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
    assert (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@needs_bf16_tiles
def test_linear_into_refuses_a_wrong_out():
    x = torch.randn(4, 64).bfloat16()
    wp = kernels.pack_bf16(torch.randn(64, 64).bfloat16())
    for bad in (torch.empty(4, 32, dtype=torch.bfloat16), torch.empty(4, 64), torch.empty(64, 4).bfloat16().t(), x):
        with pytest.raises(RuntimeError, match="linear_bf16_into"):
            kernels.linear_bf16_into(x, wp, 64, None, bad, False)


@pytest.mark.skipif(kernels is None, reason="the CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scalar", [False, True])
def test_fused_add_layer_norm_is_layer_norm_of_the_sum(dtype, scalar):
    torch.manual_seed(1)
    hidden = 392  # not a multiple of 16: the scalar tail too
    x = (torch.randn(37, hidden) * 3).to(dtype)
    res = torch.randn(37, hidden).to(dtype)
    w, b = torch.randn(hidden).to(dtype), torch.randn(hidden).to(dtype)
    ref = F.layer_norm((x + res).float(), (hidden,), w.float(), b.float(), 1e-12).to(dtype)
    before = res.clone()
    prev = kernels.fused_set_scalar(scalar)
    try:
        got = kernels.fused_add_layer_norm(x, res, w, b, 1e-12)
    finally:
        kernels.fused_set_scalar(prev)
    assert got.data_ptr() == x.data_ptr() and torch.equal(res, before)  # in place into x; the residual untouched
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    else:  # one bf16 step at most (the sum's order)
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()


def _tiny_bert(hidden: int = 128, heads: int = 4, layers: int = 2, act: str = "gelu"):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        hidden_act=act,
        vocab_size=300,
        max_position_embeddings=300,
    )
    return BertModel(cfg, add_pooling_layer=False).eval()


def _bounds(lens: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lens:
        out.append((start, n))
        start += n
    return out


def _run(enc: fused_bert.FusedEncoder, ids: list[list[int]]) -> list[torch.Tensor]:
    lens = [len(t) for t in ids]
    flat = torch.tensor([[t for s in ids for t in s]])
    pos = torch.tensor([[p for n in lens for p in range(n)]])
    hidden = enc.forward(flat, pos, torch.zeros_like(flat), cpu_prefill.segments_array(_bounds(lens)))
    return [hidden[s : s + n].clone() for s, n in _bounds(lens)]


@needs_bf16_tiles
def test_fused_encoder_matches_transformers_and_never_depends_on_the_step():
    model32 = _tiny_bert()
    model = _tiny_bert().to(torch.bfloat16)
    assert fused_bert.eligible(model, torch.bfloat16, torch.device("cpu")) is None
    enc = fused_bert.FusedEncoder(model)
    rng = torch.Generator().manual_seed(3)
    ids = [torch.randint(1, 300, (n,), generator=rng).tolist() for n in (1, 5, 64, 65, 200, 17, 130)]
    packed = _run(enc, ids)
    for seq, got in zip(ids, packed, strict=True):
        with torch.inference_mode():
            ref = model32(input_ids=torch.tensor([seq])).last_hidden_state[0]
        cos = F.cosine_similarity(got.float(), ref, dim=-1)
        assert cos.min().item() > 0.995, cos.min().item()
    # alone, and after a larger step (the workspace grown, then reused at another size): the same bits
    big = _run(enc, ids * 3)
    for i in (0, 2, 4, 6):
        assert torch.equal(_run(enc, [ids[i]])[0], packed[i]), i
        assert torch.equal(big[i + len(ids)], packed[i]), i


@needs_bf16_tiles
def test_eligibility_names_what_it_refuses():
    cpu = torch.device("cpu")
    assert fused_bert.eligible(_tiny_bert(), torch.float32, cpu) == "bf16 on the CPU only"
    assert "GELU" in fused_bert.eligible(_tiny_bert(act="relu").bfloat16(), torch.bfloat16, cpu)
    assert "head_dim" in fused_bert.eligible(_tiny_bert(hidden=64).bfloat16(), torch.bfloat16, cpu)  # 4 heads of 16
    assert fused_bert.install(_tiny_bert(act="gelu_new").bfloat16(), torch.bfloat16, cpu) is None


@needs_bf16_tiles
def test_the_pooling_runner_takes_the_fused_layers_for_a_bf16_bert(tmp_path):
    """``load_encoder`` installs the fused layers for a bf16 BERT on the CPU and the engine's vectors come from them:
    each layer's attention one kernel call, no transformers layer module called."""
    from test_embeddings_engine import _tiny_bert_dir
    from transformers import BertConfig, BertModel

    from batchery.contract.names import EMBEDDING_MODEL
    from batchery.engine.llm import LLM
    from batchery.engine.loader import hf_model_dir

    d = _tiny_bert_dir(tmp_path, hf_model_dir(EMBEDDING_MODEL))
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    BertModel(cfg).save_pretrained(d)  # two heads of 32: what the kernels take
    llm = LLM(str(d), dtype="bfloat16", device="cpu")
    loaded = llm.engine.loaded
    assert loaded.fused is not None
    called: list[str] = []
    for layer in loaded.model.encoder.layer:
        layer.register_forward_pre_hook(lambda m, a: called.append("layer"))
    outs = llm.embed(["a short one", "and a somewhat longer input than that"])
    assert not called and all(len(o.embedding) == 64 and o.error is None for o in outs)
