"""The C++ CPU prefill-attention kernel (``batchery.engine.attention.cpu_prefill``) against the torch
reference (SDPA over the gathered K/V, in float64), and the engine on it against the torch path."""

from __future__ import annotations

import pytest
import torch

from batchery.engine.attention import cpu_prefill, torch_backend
from batchery.engine.attention.metadata import AttentionMetadata, PrefillSeq


def _cpu_has_avx512() -> bool:
    from batchery.engine.fast_linear import _cpuinfo

    return "avx512f" in _cpuinfo().get("flags", "").split()


# The kernel is built with -march=native and needs AVX-512: elsewhere torch keeps prefill (see
# test_torch_keeps_prefill_without_the_kernel); where the CPU has it, a missing kernel is a failure.
needs_kernel = pytest.mark.skipif(not _cpu_has_avx512(), reason="the CPU has no AVX-512 (torch keeps prefill)")


@pytest.fixture(scope="module")
def kernel():
    if not cpu_prefill.available():
        pytest.fail("the CPU prefill-attention kernel did not build (compiler, ninja or AVX-512 missing?)")


def _step(dtype, block_size, hkv, groups, head_dim, chunks, num_decode=0, seed=0):
    """A packed step: ``num_decode`` decode tokens, then prefill chunks of (q_len, context_len), each
    with its new K/V already stored in a pool of randomly placed (non-contiguous) blocks, the way the
    model runner lays them out. q / k are head-major views ([T, H, D] of a [H, T, D] tensor), as the
    attention function receives them. Returns q, k, v, k_cache, v_cache and the metadata."""
    g = torch.Generator().manual_seed(seed)
    ctxs = [1 + (13 * i) % 40 for i in range(num_decode)] + [c for _, c in chunks]
    num_blocks = sum(-(-c // block_size) for c in ctxs) + 7
    shape = (num_blocks, block_size, hkv, head_dim)
    kc, vc = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [torch.tensor(perm[sum(-(-c // block_size) for c in ctxs[:i]) :][: -(-n // block_size)]) for i, n in
              enumerate(ctxs)]  # fmt: skip
    T = num_decode + sum(q for q, _ in chunks)
    h = hkv * groups
    q = torch.randn(h, T, head_dim, generator=g).to(dtype).transpose(0, 1)
    k = torch.randn(hkv, T, head_dim, generator=g).to(dtype).transpose(0, 1)
    v = torch.randn(T, hkv, head_dim, generator=g).to(dtype)
    slots = torch.empty(T, dtype=torch.long)
    for i in range(num_decode):
        slots[i] = tables[i][(ctxs[i] - 1) // block_size] * block_size + (ctxs[i] - 1) % block_size
    prefills, start = [], num_decode
    for (q_len, n), table in zip(chunks, tables[num_decode:]):
        pos = torch.arange(n - q_len, n)
        slots[start : start + q_len] = table[pos // block_size] * block_size + pos % block_size
        prefills.append(PrefillSeq(start, q_len, n, None if q_len == n else table))
        start += q_len
    torch_backend.store_kvcache(k, v, kc, vc, slots)
    width = max(len(t) for t in tables[:num_decode]) if num_decode else 1
    md = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=num_decode,
        decode_block_tables=torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in tables[:num_decode]])
        if num_decode
        else None,
        decode_context_lens=torch.tensor(ctxs[:num_decode]) if num_decode else None,
        prefills=prefills,
        backend="cpu",
    )
    return q, k, v, kc, vc, md


def _reference(q, k, v, kc, vc, md, scale, window, softcap=None):
    """The torch path on float64 copies (SDPA, or the explicit softmax with a softcap)."""
    ref_md = AttentionMetadata(
        slot_mapping=md.slot_mapping,
        num_decode_tokens=md.num_decode_tokens,
        decode_block_tables=md.decode_block_tables,
        decode_context_lens=md.decode_context_lens,
        prefills=md.prefills,
        backend="torch",
    )
    d = [x.double() for x in (q, k, v, kc, vc)]
    return torch_backend.paged_attention(*d, ref_md, scale, window, softcap)


NO_CACHE = [(100, 100)]
CACHED_PREFIX = [(32, 640)]
CHUNKED = [(45, 173)]  # a later chunk of a prompt: the context is not a multiple of any block size here
SEVERAL = [(7, 70), (130, 130), (1, 33), (64, 200), (3, 3)]
LAYOUTS = [(16, 3, 3, 64), (5, 2, 4, 128), (8, 4, 1, 64), (16, 1, 3, 128)]  # block size, KV heads, group, head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,hkv,groups,head_dim", LAYOUTS)
@pytest.mark.parametrize("chunks", [NO_CACHE, CACHED_PREFIX, CHUNKED, SEVERAL], ids=["new", "cached", "chunk", "many"])
@pytest.mark.parametrize("window", [None, 37])
@needs_kernel
@pytest.mark.usefixtures("kernel")
def test_cpu_prefill_matches_reference(dtype, block_size, hkv, groups, head_dim, chunks, window):
    q, k, v, kc, vc, md = _step(dtype, block_size, hkv, groups, head_dim, chunks)
    scale = head_dim**-0.5 * 2  # sharper scores make the causal edge and the window matter
    want = _reference(q, k, v, kc, vc, md, scale, window)
    out = torch.full_like(q, float("nan"))
    cpu_prefill.prefill_attention(q, k, v, kc, vc, md, out, scale, window)
    assert out.dtype == dtype and not out.isnan().any()
    err = (out.double() - want).abs().max().item()
    if dtype == torch.float32:
        assert err < 2e-5
    else:  # no worse than torch's own bf16 path (SDPA in bf16), give or take a rounding step of the output
        md.backend = "torch"
        torch_err = (torch_backend.paged_attention(q, k, v, kc, vc, md, scale, window, None).double() - want).abs()
        assert err <= max(1.5 * torch_err.max().item(), 1e-2)
    if window:  # the window really changes the result
        plain = torch.empty_like(q)
        cpu_prefill.prefill_attention(q, k, v, kc, vc, md, plain, scale, None)
        assert (plain.double() - out.double()).abs().max().item() > 0.1


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_cpu_backend_step_with_decode_and_prefill(dtype, tol):
    """paged_attention on the "cpu" backend: decode rows from the decode kernel, every prefill chunk from
    this one (in one call), contiguous q as well as head-major; on a CPU without AVX-512, from torch, and
    the kernel is never called."""
    if _cpu_has_avx512() and not cpu_prefill.available():
        pytest.fail("the CPU prefill-attention kernel did not build on a CPU with AVX-512")
    q, k, v, kc, vc, md = _step(dtype, 8, 3, 3, 64, SEVERAL, num_decode=5, seed=3)
    want = _reference(q, k, v, kc, vc, md, 0.125, None)
    calls = []
    real = cpu_prefill.prefill_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_prefill, "prefill_attention", counted)
        got = torch_backend.paged_attention(q, k, v, kc, vc, md, 0.125, None, None)
        got_c = torch_backend.paged_attention(q.contiguous(), k, v, kc, vc, md, 0.125, None, None)
    assert len(calls) == (2 if _cpu_has_avx512() else 0)
    assert (got.double() - want).abs().max().item() < tol
    assert torch.equal(got, got_c)


@pytest.mark.parametrize(
    "dtype,head_dim,softcap", [(torch.float32, 16, None), (torch.float32, 64, 3.0), (torch.float16, 64, None)]
)
def test_cpu_backend_keeps_torch_for_what_the_kernel_does_not_cover(dtype, head_dim, softcap):
    q, k, v, kc, vc, md = _step(dtype, 8, 2, 2, head_dim, SEVERAL)
    assert not cpu_prefill.supports(q, softcap)
    got = torch_backend.paged_attention(q, k, v, kc, vc, md, 0.25, 9, softcap)
    want = _reference(q, k, v, kc, vc, md, 0.25, 9, softcap)
    assert (got.double() - want).abs().max().item() < (2e-5 if dtype == torch.float32 else 1e-2)


@needs_kernel
@pytest.mark.usefixtures("kernel")
def test_cpu_prefill_one_long_prompt_uses_all_threads_and_matches():
    """One long chunk (the first prompt of a job): split into query tiles over every KV head."""
    q, k, v, kc, vc, md = _step(torch.float32, 16, 3, 3, 64, [(1030, 1030)], seed=5)
    out = torch.empty_like(q)
    cpu_prefill.prefill_attention(q, k, v, kc, vc, md, out, 0.125, None)
    assert (out.double() - _reference(q, k, v, kc, vc, md, 0.125, None)).abs().max().item() < 2e-5


# ---- the engine on the kernel --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The tiny random-weight Llama with head_dim 64 (hidden 256, 4 heads, 2 KV heads), which the kernel covers,
    its q / k projections scaled up: at init scale every score is near 0 and attention is near uniform, so
    greedy tokens would not notice a wrong mask or scale."""
    from safetensors.torch import load_file, save_file
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-64"), hidden_size=256, seed=1)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * 6
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def _greedy(engine, prompts, new_tokens):
    from batchery.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = {}
    # the first prompt alone first, so the shared document is in the prefix cache for the others
    engine.add_request("0", prompts[0], params)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("max_batched", [1024, 40])  # 40: prompts are prefilled in chunks
@needs_kernel
@pytest.mark.usefixtures("kernel")
def test_engine_greedy_on_the_kernel_matches_the_torch_path(tiny64, max_batched):
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine

    g = torch.Generator().manual_seed(0)
    document = torch.randint(10, 180, (150,), generator=g).tolist()
    prompts = [document + torch.randint(10, 180, (5 + 3 * i,), generator=g).tolist() for i in range(6)]
    cfg = dict(model=str(tiny64), dtype="float32", max_num_batched_tokens=max_batched)
    eng = LLMEngine(EngineConfig(**cfg, attention_backend="cpu"))
    ref = LLMEngine(EngineConfig(**cfg, attention_backend="torch"), loaded=eng.loaded)
    calls = []
    real = cpu_prefill.prefill_attention

    def counted(*args, **kwargs):
        calls.append(args[5].prefills)  # the metadata's chunks
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_prefill, "prefill_attention", counted)
        got = _greedy(eng, prompts, 12)
    want = _greedy(ref, prompts, 12)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.num_cached_tokens >= 144 for o in got[1:])  # the document came from the prefix cache
    chunks = [p for step in calls for p in step]
    assert any(p.block_table is not None and p.q_len < p.context_len for p in chunks)  # cached-prefix prefills ran
    assert any(p.block_table is None for p in chunks)  # and plain ones


@pytest.mark.parametrize("block_size,hkv,groups,head_dim", LAYOUTS)
@pytest.mark.parametrize("window", [None, 37])
@needs_kernel
@pytest.mark.usefixtures("kernel")
def test_cpu_prefill_on_amx_tiles_matches_the_vector_path(block_size, hkv, groups, head_dim, window):
    """On CPUs with AMX-BF16 bf16 prefill runs its dot products on tiles (16 query rows a block); the
    ``vdpbf16ps`` path stays for the rest. Both against the float64 reference, on chunks of every shape at once
    (new, cached prefix, short, 130 tokens: partial row blocks and key tiles)."""
    from batchery.engine import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.prefill_amx():
        pytest.skip("no AMX-BF16 here (or the OS did not grant it): bf16 prefill takes vdpbf16ps")
    q, k, v, kc, vc, md = _step(torch.bfloat16, block_size, hkv, groups, head_dim, SEVERAL + CACHED_PREFIX)
    scale = head_dim**-0.5 * 2
    want = _reference(q, k, v, kc, vc, md, scale, window)
    tiles, vector = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    cpu_prefill.prefill_attention(q, k, v, kc, vc, md, tiles, scale, window)
    before = kernels.prefill_set_amx(False)
    try:
        assert not kernels.prefill_amx()
        cpu_prefill.prefill_attention(q, k, v, kc, vc, md, vector, scale, window)
    finally:
        kernels.prefill_set_amx(before)
    err_tiles = (tiles.double() - want).abs().max().item()
    err_vector = (vector.double() - want).abs().max().item()
    assert not tiles.isnan().any() and not vector.isnan().any()
    assert err_tiles <= max(1.5 * err_vector, 1e-2), (err_tiles, err_vector)


SEGMENTS = [7, 130, 1, 64, 33, 200, 3, 1100]  # partial row blocks and key tiles; 1,100 keys: past the exact softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,groups,head_dim", [(12, 1, 32), (2, 3, 64)])
@pytest.mark.parametrize("causal", [False, True])
@needs_kernel
@pytest.mark.usefixtures("kernel")
def test_segment_attention_matches_sdpa_per_segment_and_never_mixes_segments(dtype, hkv, groups, head_dim, causal):
    """A pooling step (``cpu_prefill.segment_attention``): each packed input attends its own keys only, all of
    them for an encoder, up to itself for a decoder; q/k/v are [1, heads, T, D] views, as transformers hands
    them over. Against SDPA per segment in float64; and a segment's rows have the same bits alone and packed
    with the others (the embeddings' promise)."""
    g = torch.Generator().manual_seed(5)
    T, h = sum(SEGMENTS), hkv * groups
    q = torch.randn(T, h * head_dim, generator=g).to(dtype).view(T, h, head_dim)
    k = torch.randn(T, hkv * head_dim, generator=g).to(dtype).view(T, hkv, head_dim)
    v = torch.randn(T, hkv * head_dim, generator=g).to(dtype).view(T, hkv, head_dim)
    bounds = [(sum(SEGMENTS[:i]), n) for i, n in enumerate(SEGMENTS)]
    scale = head_dim**-0.5 * 2
    out = torch.full_like(q, float("nan"))
    cpu_prefill.segment_attention(q, k, v, out, cpu_prefill.segments_array(bounds), scale, causal)
    assert not out.isnan().any()
    for start, n in bounds:
        rows = slice(start, start + n)
        qs, ks, vs = (x[rows].double().transpose(0, 1) for x in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, scale=scale, is_causal=causal, enable_gqa=groups > 1
        ).transpose(0, 1)
        err = (out[rows].double() - want).abs().max().item()
        assert err < (2e-5 if dtype == torch.float32 else 3e-2), (start, n, err)
        alone = torch.full_like(q[rows], float("nan"))
        seqs = cpu_prefill.segments_array([(0, n)])
        cpu_prefill.segment_attention(q[rows], k[rows], v[rows], alone, seqs, scale, causal)
        assert torch.equal(alone, out[rows]), (start, n)
    if not causal:  # the first row of a segment sees its later keys
        causal_out = torch.empty_like(q)
        cpu_prefill.segment_attention(q, k, v, causal_out, cpu_prefill.segments_array(bounds), scale, True)
        assert (causal_out.double() - out.double()).abs().max().item() > 0.1
