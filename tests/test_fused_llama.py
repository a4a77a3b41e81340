"""The fused decoder-layer kernels (``batchery.engine.cpu_fused``) against HF's own torch code, and
``fused_llama.install`` on tiny random-weight Llamas: engine steps through the fused layers give HF's
logits and greedy tokens, every other use of the model still runs HF's forward unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from engine_util import hf_greedy
from tiny_model import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from batchery.engine import cpu_kernels, fused_llama
from batchery.engine.attention.backend import ATTN_IMPLEMENTATION, register
from batchery.engine.attention.metadata import AttentionMetadata, PrefillSeq
from batchery.engine.config import EngineConfig
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import load_model
from batchery.engine.model_runner import run_model
from batchery.engine.sampling import SamplingParams

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    k = cpu_kernels.load()
    if k is None:
        pytest.fail("the CPU kernels did not build (compiler or ninja missing?)")
    return k


@pytest.fixture(params=["vector", "scalar"])
def path(request, kernel):
    """Each kernel test on the AVX-512 path and on the scalar one (forced)."""
    if request.param == "vector" and not kernel.fused_vectorized():
        pytest.skip("built without AVX-512")
    previous = kernel.fused_set_scalar(request.param == "scalar")
    assert kernel.fused_vectorized() == (request.param == "vector")
    yield request.param
    kernel.fused_set_scalar(previous)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of two bf16 tensors in units in the last place (+0 and -0 are 0 apart)."""

    def key(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).int() & 0xFFFF
        return torch.where(i >= 0x8000, 0x8000 - i, i)

    return (key(a) - key(b)).abs()


def _close(got: torch.Tensor, ref: torch.Tensor, max_ulps: int = 2, frac: float = 1e-2) -> None:
    """fp32: within a few ulps; bf16: within max_ulps and equal but for a fraction frac of the elements."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))
    else:
        u = _ulps(got, ref)
        assert int(u.max()) <= max_ulps, f"{int(u.max())} ulps apart"
        assert float((u != 0).float().mean()) <= frac


def _norm(n: int, dtype: torch.dtype, g: torch.Generator) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(n, eps=1e-5)
    norm.weight.data = (torch.randn(n, generator=g) + 1).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 100, 576])
@torch.inference_mode()
def test_rms_norm_matches_llama_rmsnorm(kernel, path, dtype, n):
    g = torch.Generator().manual_seed(n)
    norm = _norm(n, dtype, g)
    for rows in (1, 3, 300):
        x = (torch.randn(2, rows, n, generator=g) * 3).to(dtype)
        got = kernel.fused_rms_norm(x, norm.weight, norm.variance_epsilon)
        _close(got, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 64, 100, 576])
@torch.inference_mode()
def test_add_rms_norm_adds_in_place_then_normalizes(kernel, path, dtype, n):
    g = torch.Generator().manual_seed(n)
    norm = _norm(n, dtype, g)
    for rows in (1, 5, 300):
        residual = (torch.randn(1, rows, n, generator=g) * 3).to(dtype)
        x = torch.randn(1, rows, n, generator=g).to(dtype)
        ref_residual = residual + x  # the decoder layer's add, in the model dtype
        ref = norm(ref_residual)
        got = kernel.fused_add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)
        assert torch.equal(residual, ref_residual)  # one rounded add: bit for bit
        assert got.data_ptr() == x.data_ptr()  # written over x
        _close(x, ref)


def _rope_config(rope: str, head_dim: int, heads: int) -> LlamaConfig:
    params: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "llama3":
        params = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
    return LlamaConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, head_dim=head_dim, rope_parameters=params
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,hq,hk", [(64, 9, 3), (16, 4, 2), (24, 3, 1), (128, 2, 2), (2, 1, 1)])
@pytest.mark.parametrize("rope", ["default", "llama3"])
@torch.inference_mode()
def test_rope_matches_apply_rotary_pos_emb(kernel, path, dtype, head_dim, hq, hk, rope):
    g = torch.Generator().manual_seed(head_dim)
    rotary = LlamaRotaryEmbedding(_rope_config(rope, head_dim, hq))
    for t in (1, 37, 300):
        pos = torch.randint(0, 4000, (1, t), generator=g)
        q = torch.randn(1, t, hq * head_dim, generator=g).to(dtype)
        k = torch.randn(1, t, hk * head_dim, generator=g).to(dtype)
        cos, sin = rotary(q, pos)
        # HF: [1, heads, T, D] views of the projections
        ref_q, ref_k = apply_rotary_pos_emb(
            q.view(1, t, hq, head_dim).transpose(1, 2), k.view(1, t, hk, head_dim).transpose(1, 2), cos, sin
        )
        kernel.fused_rope(q, k, cos[0].contiguous(), sin[0].contiguous())
        for got, ref, h in ((q, ref_q, hq), (k, ref_k, hk)):
            got = got.view(1, t, h, head_dim).transpose(1, 2)
            if dtype == torch.bfloat16:  # the same roundings: bit for bit
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 300 * 1536])
@torch.inference_mode()
def test_silu_mul_matches_llama_mlp_activation(kernel, path, dtype, n):
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=g) * 4).to(dtype)
    gate[:3] = torch.tensor([-100.0, 100.0, 0.0])[: min(n, 3)]  # exp over- and underflows
    up = torch.randn(n, generator=g).to(dtype)
    ref = F.silu(gate) * up
    got = kernel.fused_silu_mul(gate, up)
    assert got.data_ptr() == gate.data_ptr()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    else:
        _close(got, ref, max_ulps=1, frac=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 300 * 1536])
@torch.inference_mode()
def test_gelu_matches_torch_within_a_step_and_beats_it_against_float64(kernel, path, dtype, n):
    """``fused_gelu`` (the encoders' BertIntermediate activation, erf form) in place: fp32 within an ulp or so of
    torch's; bf16 equal to the float64 GELU rounded once wherever x > -3, and elsewhere (tiny results) no further from
    it than torch's own bf16 GELU; over- and underflowing inputs stay finite."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 4).to(dtype)
    x[:4] = torch.tensor([-100.0, 100.0, 0.0, -3.0])[: min(n, 4)]
    exact, ref, xin = F.gelu(x.double()), F.gelu(x), x.clone()
    got = kernel.fused_gelu(x)
    assert got.data_ptr() == x.data_ptr() and got.isfinite().all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
        return
    fair = xin > -3  # below, GELU is under 0.004 in size and both polynomials are off by more than bf16's steps
    assert torch.equal(got[fair], exact.to(torch.bfloat16)[fair])
    far_ours, far_torch = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert far_ours <= far_torch + 1e-12, (far_ours, far_torch)


def _bf16_with_specials(shape: tuple[int, ...], g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random bf16 values with NaNs, zeros, infinities and bf16 denormals put at random places (one element in 97),
    so that some 16-lane vectors hold them and most do not."""
    t = torch.randn(*shape, generator=g) * scale
    flat = t.view(-1)
    specials = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, float("inf"), -float("inf"), 1e-39, -3e-40, 1e-45])
    picks = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 97)]
    flat[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    return t.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("op", ["silu_mul", "add_rms_norm", "rms_norm", "rope"])
@torch.inference_mode()
def test_bf16_vector_rounding_is_the_scalar_paths_bit_for_bit(kernel, op):
    """The AVX-512 path rounds to bf16 with vcvtneps2bf16 where the CPU has AVX512-BF16, except in vectors holding a
    NaN, zero or denormal, where that instruction differs from c10::BFloat16 (NaN payloads, denormals flushed):
    every kernel must give the scalar path's bits, NaN, denormal and infinity results included. Tiny inputs make
    denormal intermediates (a bf16 denormal times 0.7 is an fp32 denormal)."""
    if not kernel.fused_vectorized():
        pytest.skip("built without AVX-512")
    g = torch.Generator().manual_seed(7)
    n, rows = 576, 40
    outs = []
    for scalar in (False, True):
        previous = kernel.fused_set_scalar(scalar)
        try:
            g.manual_seed(7)
            if op == "silu_mul":
                gate, up = _bf16_with_specials((rows, 1536), g, 4.0), _bf16_with_specials((rows, 1536), g)
                up[::3] = (up[::3].float() * 1e-38).to(torch.bfloat16)  # products in the denormal range
                outs.append(kernel.fused_silu_mul(gate, up).clone())
            elif op in ("add_rms_norm", "rms_norm"):
                w = _bf16_with_specials((n,), g)
                residual, x = _bf16_with_specials((rows, n), g), _bf16_with_specials((rows, n), g)
                residual[::2] = (residual[::2].float() * 1e-38).to(torch.bfloat16)  # denormal sums and norms
                x[::2] = (x[::2].float() * 1e-38).to(torch.bfloat16)
                if op == "rms_norm":
                    outs.append(kernel.fused_rms_norm(residual, w, 1e-30).clone())
                else:
                    kernel.fused_add_rms_norm(residual, x, w, 1e-30)
                    outs.append(torch.cat([residual, x]).clone())
            else:
                d, hq, hk = 64, 9, 3
                q, k = _bf16_with_specials((rows, hq * d), g), _bf16_with_specials((rows, hk * d), g)
                q[::2] = (q[::2].float() * 1e-38).to(torch.bfloat16)
                cos, sin = torch.rand(rows, d, generator=g).to(torch.bfloat16), torch.rand(rows, d, generator=g)
                kernel.fused_rope(q, k, cos, sin.to(torch.bfloat16))
                outs.append(torch.cat([q.view(-1), k.view(-1)]).clone())
        finally:
            kernel.fused_set_scalar(previous)
    vector, scalar_out = outs
    values = vector.float()
    assert bool(torch.isnan(values).any()), "no NaN result: the case no longer tests NaN rounding"
    assert bool(((values.abs() < 1.2e-38) & (values != 0)).any()), "no denormal result: the case tests none"
    mismatch = (_bits(vector) != _bits(scalar_out)).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"


def test_kernels_reject_what_they_cannot_do(kernel):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.fused_rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.fused_rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        kernel.fused_rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="differ"):
        kernel.fused_add_rms_norm(x, x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="shape"):
        kernel.fused_silu_mul(x, torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="even"):
        kernel.fused_rope(x, x.clone(), torch.ones(4, 3), torch.ones(4, 3))
    with pytest.raises(RuntimeError, match="heads"):
        kernel.fused_rope(torch.randn(4, 12), torch.randn(4, 8), torch.ones(4, 8), torch.ones(4, 8))


# ---- the fused forward on tiny models ----------------------------------------------------------------

SHAPES = {
    # head_dim 64: every kernel's vector loop
    "wide": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
    # odd sizes (head_dim 24, 3 heads on 1 KV head), three layers, llama3 rope scaling
    "odd": dict(
        hidden_size=72,
        intermediate_size=100,
        num_attention_heads=3,
        num_key_value_heads=1,
        num_hidden_layers=3,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def _llama_config(shape: str, **overrides) -> LlamaConfig:
    tok = build_tokenizer()
    kw: dict = dict(
        vocab_size=len(tok),
        num_hidden_layers=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # sharp logits: greedy choices are not near-ties
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    kw.update(SHAPES[shape])
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="module", params=list(SHAPES))
def llama_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    torch.manual_seed(1234)
    LlamaForCausalLM(_llama_config(request.param)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _steps(model: torch.nn.Module, kernel_backend: str) -> list[torch.Tensor]:
    """Logits of a prefill step of two sequences, then of a decode step of both, as run_model computes them."""
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    bs, lens = 4, (13, 6)
    caches = [
        (torch.zeros(16, bs, hkv, d, dtype=dtype), torch.zeros(16, bs, hkv, d, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    tables = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11]])
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(10, cfg.vocab_size, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    slots = torch.cat([tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs for i, n in enumerate(lens)])
    md = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillSeq(0, lens[0], lens[0], None), PrefillSeq(lens[0], lens[1], lens[1], None)],
        kv_caches=caches,
        backend=kernel_backend,
    )
    out = [run_model(model, ids, pos, md)]
    dpos = torch.tensor([lens])
    md = AttentionMetadata(
        slot_mapping=torch.stack([tables[i, n // bs] * bs + n % bs for i, n in enumerate(lens)]),
        num_decode_tokens=2,
        decode_block_tables=tables,
        decode_context_lens=dpos[0] + 1,
        kv_caches=caches,
        backend=kernel_backend,
    )
    out.append(run_model(model, torch.randint(10, cfg.vocab_size, (1, 2), generator=g), dpos, md))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fused_step_logits_match_hf_layers(kernel, llama_dir, dtype, backend):
    loaded = load_model(EngineConfig(model=llama_dir, dtype=dtype))
    model = loaded.model
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    n = model.config.num_hidden_layers
    assert fused_llama.install(model) == n  # the loader installed it; installing again changes nothing
    fused = _steps(model, backend)
    assert fused_llama.fused_steps(model) == 2
    assert fused_llama.uninstall(model) and fused_llama.fused_steps(model) == 0
    hf = _steps(model, backend)
    for a, b in zip(fused, hf, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = float(b.float().abs().max())
        tol = 1e-5 if dtype == "float32" else 3e-2
        assert float((a.float() - b.float()).abs().max()) <= tol * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1)) or dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_with_fused_layers_equals_without_and_hf(kernel, llama_dir, dtype):
    loaded = load_model(EngineConfig(model=llama_dir, dtype=dtype))
    prompts = [[11, 12, 13], list(range(20, 50)), [17] * 9, [30, 31, 32, 33, 34]]
    new = 16
    attn = loaded.model.model.layers[0].self_attn
    if all(getattr(lin, "_batchery_max_rows", 0) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)):
        assert callable(getattr(attn, "_batchery_qkv", None))  # the loader gave the fused layers their q/k/v pass

    def generate() -> tuple[list[list[int]], list[list[float]]]:
        # small blocks and a small token budget: multi-block tables, chunked prefill, mixed steps
        eng = LLMEngine(
            EngineConfig(model=llama_dir, dtype=dtype, block_size=4, max_num_batched_tokens=16), loaded=loaded
        )
        params = SamplingParams(temperature=0, max_tokens=new, min_tokens=new, logprobs=0)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        return (
            [outs[str(i)].token_ids for i in range(len(prompts))],
            [[e["logprob"] for e in outs[str(i)].logprobs] for i in range(len(prompts))],
        )

    tokens, lps = generate()
    assert fused_llama.fused_steps(loaded.model) > 0
    fused_llama.uninstall(loaded.model)
    ref_tokens, ref_lps = generate()
    if dtype == "float32":
        assert tokens == ref_tokens
        for a, b in zip(lps, ref_lps, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
        for p, got in zip(prompts, tokens, strict=True):  # and HF generate's own greedy tokens
            assert got == hf_greedy(loaded, p, new)
    else:  # bf16: HF's roundings, a norm's sum in another order; the first tokens agree
        for got, ref in zip(tokens, ref_tokens, strict=True):
            assert got[:4] == ref[:4]
        assert abs(lps[0][0] - ref_lps[0][0]) < 5e-2


def test_scalar_kernels_leave_large_steps_to_hf(kernel, llama_dir, monkeypatch):
    """Without AVX-512 (forced here) a step of more than SCALAR_MAX_ROWS tokens takes HF's forward; a smaller
    one the fused path; with the vector path every step is fused. The logits are HF's either way."""
    loaded = load_model(EngineConfig(model=llama_dir, dtype="float32"))
    model = loaded.model
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    fused_llama.install(model)
    previous = kernel.fused_set_scalar(True)
    try:
        monkeypatch.setattr(fused_llama, "SCALAR_MAX_ROWS", 10)  # the prefill step packs 19 tokens, the decode 2
        before = fused_llama.fused_steps(model)
        scalar = _steps(model, "torch")
        assert fused_llama.fused_steps(model) == before + 1  # the decode step only
        monkeypatch.setattr(fused_llama, "SCALAR_MAX_ROWS", 64)
        both = _steps(model, "torch")
        assert fused_llama.fused_steps(model) == before + 3
    finally:
        kernel.fused_set_scalar(previous)
    if kernel.fused_vectorized():
        monkeypatch.setattr(fused_llama, "SCALAR_MAX_ROWS", 10)
        _steps(model, "torch")
        assert fused_llama.fused_steps(model) == before + 5
    fused_llama.uninstall(model)
    hf = _steps(model, "torch")
    for got in (scalar, both):
        for a, b in zip(got, hf, strict=True):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_paths_unchanged_after_install(kernel, llama_dir, dtype):
    loaded = load_model(EngineConfig(model=llama_dir, dtype=dtype))
    model = loaded.model
    assert fused_llama.install(model) == model.config.num_hidden_layers
    ids = torch.tensor([[5, 9, 14, 22, 31, 40, 41]])
    with torch.inference_mode():
        plain = model(input_ids=ids).logits  # sdpa, no engine step: HF's forward
        gen = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    gen_lps = hf_greedy(loaded, ids[0].tolist(), 6, with_logprobs=True)
    assert fused_llama.fused_steps(model) == 0
    fused_llama.uninstall(model)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, plain)
        assert torch.equal(
            model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0), gen
        )
    assert hf_greedy(loaded, ids[0].tolist(), 6, with_logprobs=True) == gen_lps
    # with our attention set but no engine step, the call fails as HF's forward does (no metadata)
    fused_llama.install(model)
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside an engine step"):
        model(input_ids=ids, use_cache=False)


def _refused(config) -> int:
    torch.manual_seed(0)
    cls = Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM
    return fused_llama.install(cls(config).eval())


def test_install_refuses_other_structures(kernel):
    assert _refused(_llama_config("wide")) == 2  # the plain one is accepted
    assert _refused(_llama_config("wide", attention_bias=True)) == 0
    assert _refused(_llama_config("wide", mlp_bias=True)) == 0
    assert _refused(_llama_config("wide", hidden_act="gelu")) == 0
    assert _refused(Qwen2Config(**SHAPES["wide"], vocab_size=128, num_hidden_layers=2)) == 0
    torch.manual_seed(0)
    half = LlamaForCausalLM(_llama_config("wide")).to(torch.float16)
    assert fused_llama.install(half) == 0
    hooked = LlamaForCausalLM(_llama_config("wide"))
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert fused_llama.install(hooked) == 0


def test_install_without_kernels_installs_nothing(tiny_model_dir):
    code = (
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from batchery.engine import fused_llama\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})\n"
        "print('installed', fused_llama.install(m))\n"
    )
    env = dict(os.environ, BATCHERY_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "installed 0" in out.stdout
