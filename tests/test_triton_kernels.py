"""Paged KV-cache Triton kernels against dense torch references.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 must be set
before triton is imported); with CUDA they are compiled and run on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from batchery.engine.attention.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    ref_paged_decode_attention,
    ref_paged_prefill_attention,
    store_kvcache,
)

if os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.zeros, triton.JITFunction):
    # triton chooses interpreter or compiler as each @jit function is defined, its own
    # triton.language helpers included, so the variable must be set before triton is imported.
    pytest.fail(
        "triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py or the environment",
        pytrace=False,
    )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


@pytest.fixture(autouse=True)
def _interpreter_scalar_index(monkeypatch):
    """Works around triton-lang/triton#9171 in the CPU interpreter.

    With numpy >= 2.4 the triton 3.6 interpreter cannot use a loaded scalar as a ``range``
    bound (it calls ``int()`` on a 1-element array). The upstream fix converts via
    ``squeeze()``; apply the same conversion here until the pinned triton carries it.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v


def _block_tables(context_lens, block_size, gen, spare_blocks=3):
    """Shuffled, non-contiguous block tables padded with 0 (block 0 is never allocated)."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(needed) + spare_blocks
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(max(needed), 1) + 1  # one extra column of padding
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return table.to(DEVICE), num_blocks


def _assert_close(actual, expected, dtype):
    tol = TOL[dtype]
    assert actual.dtype == expected.dtype == dtype
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 2, 32), (16, 3, 80)])
def test_store_kvcache_writes_slots_and_skips_minus_one(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 5, 13
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    # key/value as non-contiguous views of a fused projection, like a real model produces
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(DEVICE)

    store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    expected_k = k_before.view(-1, num_kv_heads, head_dim).clone()
    expected_v = v_before.view(-1, num_kv_heads, head_dim).clone()
    keep = slot_mapping >= 0
    expected_k[slot_mapping[keep]] = key[keep]
    expected_v[slot_mapping[keep]] = value[keep]
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim), expected_k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim), expected_v)


def test_store_then_attend_matches_dense_attention():
    """Prefill K/V go in through store_kvcache; attention over them matches plain causal SDPA."""
    gen = torch.Generator().manual_seed(1)
    block_size, num_heads, num_kv_heads, head_dim, seq_len = 8, 4, 2, 32, 21
    table, num_blocks = _block_tables([seq_len], block_size, gen)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    pos = torch.arange(seq_len, device=DEVICE)
    slot_mapping = table[0].long()[pos // block_size] * block_size + pos % block_size
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale=0.2)

    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
        scale=0.2,
    ).transpose(0, 1)
    _assert_close(out, expected, torch.float32)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------

DECODE_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, sliding_window, softcap
    (8, 4, 4, 32, None, None),
    (16, 6, 2, 64, None, None),
    (8, 8, 2, 64, None, 30.0),
    (16, 4, 1, 32, 7, None),
    (8, 6, 2, 32, 20, 50.0),
    (16, 3, 3, 80, None, None),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,sliding_window,softcap", DECODE_CASES)
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, head_dim, sliding_window, softcap):
    gen = torch.Generator().manual_seed(2)
    context_lens = [1, 9, 40, 77]
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    out = paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, sliding_window, softcap)
    expected = ref_paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, sliding_window, softcap)
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("sliding_window", [None, 30])
def test_decode_split_context_matches_reference(num_splits, sliding_window):
    gen = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim = 8, 4, 2, 32
    context_lens = [0, 5, 70, 150]  # a padding row, and rows whose later partitions are empty
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)

    out = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.3, sliding_window, 40.0, num_splits=num_splits)
    single = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.3, sliding_window, 40.0, num_splits=1)
    expected = ref_paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.3, sliding_window, 40.0)
    _assert_close(out, expected, torch.float32)
    _assert_close(single, expected, torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_ignores_blocks_outside_the_table():
    """Poisoning every slot the block table does not cover must not change the result."""
    gen = torch.Generator().manual_seed(4)
    block_size, num_heads, num_kv_heads, head_dim = 8, 2, 1, 32
    context_lens = [11, 3]
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(2, num_heads, head_dim, generator=gen).to(DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    before = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2)

    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, c in enumerate(context_lens):
        pos = torch.arange(c)
        used[table[i].cpu().long()[pos // block_size] * block_size + pos % block_size] = True
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    flat_k[~used.to(DEVICE)] = 1e4
    flat_v[~used.to(DEVICE)] = float("nan")
    after = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2)
    assert torch.equal(before, after)


# Contexts far shorter than a max_model_len-wide table (8192 tokens in 1024 blocks of 8), in one
# batch: a padding row, one token, a partial tile, several tiles, exactly one and exactly 64
# blocks (a tile and a block boundary), and one past that boundary.
_WIDE_CONTEXTS = [0, 1, 7, 100, 64, 512, 513]
_WIDE_BLOCKS = 1024


def _wide_table(context_lens, block_size, gen):
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    wide = torch.zeros(len(context_lens), _WIDE_BLOCKS, dtype=torch.int32, device=DEVICE)
    wide[:, : table.shape[1]] = table
    return wide, num_blocks


def _expected_partitions(ctx, window, num_splits, block_n):
    """[(lo, hi)] of the partitions that hold keys: the span cut into num_splits whole tiles."""
    start = max(ctx - window, 0) if window else 0
    span = ctx - start
    part = max(triton.cdiv(triton.cdiv(span, num_splits), block_n), 1) * block_n
    return [(lo, min(lo + part, ctx)) for lo in range(start, ctx, part)]


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (50, 30.0)])
def test_decode_splits_follow_real_context_not_table_width(num_splits, sliding_window, softcap):
    """Each partition's bounds come from the sequence's own context: with a table 8192 tokens wide
    a 513-token context still spreads over the partitions, a span of one tile is finished by
    partition 0 alone, and partitions past the span neither write partials nor get read (they are
    NaN here, which any read would carry into the output)."""
    from batchery.engine.attention.triton_attention import _decode_config

    gen = torch.Generator().manual_seed(8)
    block_size, num_heads, num_kv_heads, head_dim, scale = 8, 4, 2, 32, 0.2
    table, num_blocks = _wide_table(_WIDE_CONTEXTS, block_size, gen)
    assert table.shape[1] * block_size == 8192
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    n = len(_WIDE_CONTEXTS)
    q = torch.randn(n, num_heads, head_dim, generator=gen).to(DEVICE)
    ctx = torch.tensor(_WIDE_CONTEXTS, dtype=torch.int32, device=DEVICE)
    part_out = torch.full((n, num_heads, num_splits, head_dim), float("nan"), device=DEVICE)
    part_m = torch.full((n, num_heads, num_splits), float("nan"), device=DEVICE)
    part_l = part_m.clone()

    out = paged_decode_attention(
        q, k_cache, v_cache, table, ctx, scale, sliding_window, softcap, num_splits, partials=(part_out, part_m, part_l)
    )
    expected = ref_paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, sliding_window, softcap)
    _assert_close(out, expected, torch.float32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    if num_splits == 1:
        assert part_out.isnan().all() and part_m.isnan().all()  # the split path was not taken
        return

    block_n, _ = _decode_config(triton.next_power_of_2(head_dim), torch.float32)
    group = num_heads // num_kv_heads
    for i, c in enumerate(_WIDE_CONTEXTS):
        bounds = _expected_partitions(c, sliding_window, num_splits, block_n)
        written = [] if len(bounds) <= 1 else bounds  # one partition: finished in place
        for s in range(num_splits):
            if s >= len(written):
                assert part_out[i, :, s].isnan().all(), (c, s)
                assert part_m[i, :, s].isnan().all() and part_l[i, :, s].isnan().all(), (c, s)
                continue
            lo, hi = written[s]
            pos = torch.arange(lo, hi, device=DEVICE)
            rows = table[i].long()[pos // block_size] * block_size + pos % block_size
            k = k_cache.view(-1, num_kv_heads, head_dim)[rows].repeat_interleave(group, 1)
            v = v_cache.view(-1, num_kv_heads, head_dim)[rows].repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", q[i], k) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            top = scores.max(-1).values
            torch.testing.assert_close(part_m[i, :, s], top * 1.4426950408889634, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(part_l[i, :, s], torch.exp(scores - top[:, None]).sum(-1), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(
                part_out[i, :, s], torch.einsum("hk,khd->hd", scores.softmax(-1), v), atol=1e-4, rtol=1e-4
            )
    # Without a window the 513-token context fills 9 of 16 partitions of 64 keys (4 of 4 of
    # 160); cut by the table's width, every key would sit in partition 0.
    if sliding_window is None:
        assert len(_expected_partitions(513, None, num_splits, block_n)) == {4: 4, 16: 9}[num_splits]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts loads inside the Triton interpreter")
def test_decode_partitions_past_the_span_load_nothing(monkeypatch):
    """Counts, per program, the K/V and partial elements the kernels actually load (the
    interpreter's masked loads, by address): every key is read once, by the partition whose
    in-kernel bounds hold it, partitions past the span read no K/V at all, and the reduce reads
    the float32 partials of the partitions that hold keys only, none for a span of one tile."""
    from collections import Counter

    from triton.runtime import interpreter

    from batchery.engine.attention.triton_attention import _decode_config

    gen = torch.Generator().manual_seed(10)
    block_size, num_heads, num_kv_heads, head_dim, num_splits = 8, 4, 2, 32, 16
    contexts = [7, 100, 513]
    table, num_blocks = _wide_table(contexts, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    part_out = torch.empty(len(contexts), num_heads, num_splits, head_dim)
    part_m = torch.empty(len(contexts), num_heads, num_splits)
    partials = (part_out, part_m, torch.empty_like(part_m))

    regions = {"k": k_cache, "v": v_cache, "part_out": part_out}
    loaded: Counter[tuple[str, tuple[int, int, int]]] = Counter()
    original = interpreter.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, *args):
        addrs = ptrs.data[mask.data.astype(bool)]
        for name, t in regions.items():
            lo = t.data_ptr()
            n = int(((addrs >= lo) & (addrs < lo + t.numel() * t.element_size())).sum())
            if n:
                loaded[name, self.grid_idx] += n
        return original(self, ptrs, mask, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting_load)
    out = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2, num_splits=num_splits, partials=partials)
    monkeypatch.undo()
    _assert_close(out, ref_paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.2), torch.float32)

    block_n, _ = _decode_config(triton.next_power_of_2(head_dim), torch.float32)
    for i, c in enumerate(contexts):
        bounds = _expected_partitions(c, None, num_splits, block_n)
        for h in range(num_kv_heads):
            for s in range(num_splits):
                keys = bounds[s][1] - bounds[s][0] if s < len(bounds) else 0
                assert loaded["k", (i, h, s)] == keys * head_dim, (c, h, s)
                assert loaded["v", (i, h, s)] == keys * head_dim, (c, h, s)
        for head in range(num_heads):  # the reduce grid is (seq, head, 0)
            merged = len(bounds) if len(bounds) > 1 else 0
            assert loaded["part_out", (i, head, 0)] == merged * head_dim, (c, head)
    # 7 keys: one program of 16 does the work; 513 keys: nine of 64, none of them all 513.
    assert [len(_expected_partitions(c, None, num_splits, block_n)) for c in contexts] == [1, 4, 9]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_split_decode_over_a_wide_table(dtype):
    _skip_unless_backend_dots(dtype)
    gen = torch.Generator().manual_seed(9)
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 2, 64
    table, num_blocks = _wide_table(_WIDE_CONTEXTS, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(_WIDE_CONTEXTS), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    ctx = torch.tensor(_WIDE_CONTEXTS, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    expected = ref_paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, softcap=30.0)
    for num_splits in (1, 5, 16):
        out = paged_decode_attention(q, k_cache, v_cache, table, ctx, scale, softcap=30.0, num_splits=num_splits)
        _assert_close(out, expected, dtype)


def test_decode_rejects_partials_of_the_wrong_shape():
    k_cache = torch.zeros(2, 8, 1, 32, device=DEVICE)
    q = torch.zeros(1, 2, 32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    stats = torch.zeros(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="partials out"):
        paged_decode_attention(
            q, k_cache, k_cache.clone(), table, ctx, 1.0, num_splits=4, partials=(stats, stats, stats)
        )


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # block_size, num_heads, num_kv_heads, head_dim, sliding_window, softcap, cached prefix
    (8, 4, 4, 32, None, None, False),
    (16, 6, 2, 64, None, None, True),
    (8, 4, 1, 32, None, 50.0, True),
    (16, 8, 2, 32, 9, None, False),
    (8, 6, 2, 64, 24, 30.0, True),
    (16, 3, 3, 80, 16, None, True),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,sliding_window,softcap,prefix", PREFILL_CASES)
def test_prefill_matches_reference(block_size, num_heads, num_kv_heads, head_dim, sliding_window, softcap, prefix):
    gen = torch.Generator().manual_seed(5)
    # (query tokens, context length); with a prefix, the context is longer than the query
    if prefix:
        seqs = [(5, 29), (1, 9), (70, 83), (16, 16)]
    else:
        seqs = [(5, 5), (1, 1), (70, 70), (17, 17)]
    q_lens, context_lens = zip(*seqs)
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    out = paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale, sliding_window, softcap)
    expected = ref_paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale, sliding_window, softcap)
    _assert_close(out, expected, torch.float32)


def test_prefill_last_token_equals_decode():
    gen = torch.Generator().manual_seed(6)
    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    context_lens = [12, 37]
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(2, num_heads, head_dim, generator=gen).to(DEVICE)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)

    prefill = paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, 0.25, 10, 30.0)
    decode = paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.25, 10, 30.0)
    _assert_close(prefill, decode, torch.float32)


# --------------------------------------------------------------------------------------------
# half precision
# --------------------------------------------------------------------------------------------


@triton.jit
def _dot_probe_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    tl.store(out_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


def _skip_unless_backend_dots(dtype):
    """The CPU interpreter computes tl.dot wrongly for some dtypes (bfloat16 in triton 3.6)."""
    if DEVICE == "cuda":
        return
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    out = torch.zeros(16, 16)
    try:
        _dot_probe_kernel[(1,)](a, b, out, N=16)
    except Exception as exc:
        pytest.skip(f"Triton interpreter cannot run tl.dot on {dtype}: {exc!r}")
    if not torch.allclose(out, a.float() @ b.float(), atol=1e-2, rtol=1e-2):
        pytest.skip(f"Triton interpreter computes tl.dot on {dtype} incorrectly")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_decode_and_prefill(dtype):
    _skip_unless_backend_dots(dtype)
    gen = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_dim = 16, 4, 2, 64
    seqs = [(3, 20), (40, 40)]
    q_lens, context_lens = zip(*seqs)
    table, num_blocks = _block_tables(context_lens, block_size, gen)
    k_cache, v_cache = _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    q_dec = torch.randn(2, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    dec = paged_decode_attention(q_dec, k_cache, v_cache, table, ctx, scale, softcap=30.0)
    expected_dec = ref_paged_decode_attention(q_dec, k_cache, v_cache, table, ctx, scale, softcap=30.0)
    _assert_close(dec, expected_dec, dtype)

    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0, 3, 43], dtype=torch.int32, device=DEVICE)
    pre = paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale, sliding_window=12)
    expected_pre = ref_paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, scale, sliding_window=12)
    _assert_close(pre, expected_pre, dtype)


# --------------------------------------------------------------------------------------------
# argument validation
# --------------------------------------------------------------------------------------------


def test_rejects_head_counts_that_do_not_group():
    k_cache = torch.zeros(2, 8, 3, 32, device=DEVICE)
    q = torch.zeros(1, 4, 32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    ctx = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q, k_cache, k_cache.clone(), table, ctx, 1.0)


def test_rejects_dtype_mismatch_in_store():
    k_cache = torch.zeros(2, 8, 1, 32, device=DEVICE)
    key = torch.zeros(3, 1, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        store_kvcache(key, key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.long, device=DEVICE))


def test_engine_with_triton_backend_matches_torch_backend(tiny_model_dir):
    """The whole engine on the Triton path (decode + varlen prefill with cached prefix, chunked)
    gives the same greedy tokens and logprobs as the torch reference path."""
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.sampling import SamplingParams

    base = dict(model=str(tiny_model_dir), dtype="float32", device=DEVICE, block_size=4, max_num_batched_tokens=8)
    loaded = load_model(EngineConfig(**base))
    prompts = [[5, 9, 14, 20, 7, 8, 30, 31, 12], [5, 9, 14, 20, 7, 8, 41], [60, 61, 62]]
    results = {}
    for backend in ("torch", "triton"):
        eng = LLMEngine(EngineConfig(**base, attention_backend=backend), loaded=loaded)
        assert eng.runner.backend == backend
        params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=0)
        eng.add_request("0", prompts[0], params)
        outs = {}
        while eng.has_unfinished():  # the first prompt runs alone, so the next one hits its prefix
            for o in eng.step():
                outs[o.request_id] = o
        for i, p in enumerate(prompts[1:], 1):
            eng.add_request(str(i), p, params)
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        assert outs["1"].num_cached_tokens == 4
        results[backend] = [outs[str(i)] for i in range(len(prompts))]
    for a, b in zip(results["torch"], results["triton"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_decode_graph_buffers_match_eager_steps(tiny_model_dir):
    """The CUDA-graph decode path without the capture (static buffers, padded buckets) gives the
    same greedy tokens and logprobs as eager steps, while the batch shrinks through its buckets
    and padding rows sit where an earlier, larger batch left real slots and block tables."""
    from batchery.engine.config import EngineConfig
    from batchery.engine.cuda_graphs import bucket_sizes
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.sampling import SamplingParams

    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(1) == [1]
    base = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        device=DEVICE,
        block_size=4,
        max_num_seqs=6,
        attention_backend="triton",
    )
    loaded = load_model(EngineConfig(**base))
    shared = [5, 9, 14, 20, 7, 8, 30, 31]  # two full blocks every prompt shares
    prompts = [shared + [40 + i] * (i + 1) for i in range(5)]
    results = {}
    for graphs in (False, True):
        eng = LLMEngine(EngineConfig(**base), loaded=loaded)
        assert eng.runner.graphs is None  # not on the CPU
        if graphs:
            eng.runner.graphs = eng.runner.build_decode_graphs(capture=False)
            assert not hasattr(eng.runner.graphs, "runner")  # they hold the model's forward, not the runner
        outs = {}
        for i, p in enumerate(prompts):  # lengths 3..11: the batch shrinks 5 -> 4 -> ... -> 1
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=0))
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] = o
        if graphs:
            assert eng.stats()["cuda_graph_steps"] >= 9  # every decode step went through the buffers
        results[graphs] = [outs[str(i)] for i in range(len(prompts))]
    for a, b in zip(results[False], results[True]):
        assert a.token_ids == b.token_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
