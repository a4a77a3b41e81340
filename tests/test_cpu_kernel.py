"""The C++ CPU paged-decode kernel against the torch reference (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchery.engine.attention import cpu_paged, torch_backend
from batchery.engine.attention.metadata import AttentionMetadata


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if cpu_paged.load() is None:
        pytest.fail("the CPU paged-attention kernel did not build (compiler or ninja missing?)")


def _case(dtype, block_size, hkv, groups, head_dim, seed=0, ctx=None):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.tensor(ctx or (1, 7, block_size, 3 * block_size + 5, 50))
    b = len(ctx)
    num_blocks = int(sum(-(-n // block_size) for n in ctx.tolist())) + 8
    kc = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    width = int((ctx.max() + block_size - 1) // block_size)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(b, width, dtype=torch.long)
    used = 0
    for i, n in enumerate(ctx.tolist()):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(b, hkv * groups, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, ctx


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "block_size,hkv,groups,head_dim",
    [(16, 3, 3, 64), (5, 3, 3, 64), (8, 2, 4, 128), (4, 2, 1, 32), (8, 1, 4, 16), (8, 1, 5, 64), (3, 2, 3, 128)],
)
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (9, 2.0)])
def test_cpu_decode_matches_reference(dtype, tol, block_size, hkv, groups, head_dim, window, softcap):
    q, kc, vc, tables, ctx = _case(dtype, block_size, hkv, groups, head_dim)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(ctx), dtype=torch.long),
        num_decode_tokens=len(ctx),
        decode_block_tables=tables,
        decode_context_lens=ctx,
    )
    scale = head_dim**-0.5 * 4  # sharper scores make the window and the cap matter
    ref = torch_backend.paged_attention(q, None, None, kc, vc, md, scale, window, softcap)
    got = cpu_paged.paged_decode(q, kc, vc, tables, ctx, scale, window, softcap)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert (got.float() - ref.float()).abs().max().item() < tol
    if window or softcap:  # the options really change the result
        plain = cpu_paged.paged_decode(q, kc, vc, tables, ctx, scale, None, None)
        assert (plain.float() - got.float()).abs().max().item() > 10 * tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim,window,softcap", [(64, None, None), (128, 13, None), (64, None, 2.0), (48, 7, 1.5)])
def test_cpu_decode_many_sequences(dtype, tol, head_dim, window, softcap):
    """Enough sequences that each kernel task takes all KV heads of a sequence (the other split)."""
    ctx = tuple(1 + (37 * i) % 97 for i in range(max(24, 4 * torch.get_num_threads())))
    q, kc, vc, tables, ctx = _case(dtype, 16, 3, 3, head_dim, seed=1, ctx=ctx)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(len(ctx), dtype=torch.long),
        num_decode_tokens=len(ctx),
        decode_block_tables=tables,
        decode_context_lens=ctx,
    )
    scale = head_dim**-0.5 * 4
    ref = torch_backend.paged_attention(q, None, None, kc, vc, md, scale, window, softcap)
    got = cpu_paged.paged_decode(q, kc, vc, tables, ctx, scale, window, softcap)
    assert (got.float() - ref.float()).abs().max().item() < tol


def test_engine_picks_the_cpu_kernel_on_cpu(tiny_model_dir):
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    assert eng.runner.backend == "cpu"
    ref = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", attention_backend="torch"), loaded=eng.loaded
    )
    assert ref.runner.backend == "torch"


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 131])
@pytest.mark.parametrize("out_features,bias", [(16, False), (48, True), (200 * 16 + 32, True)])
def test_fast_linear_matches_torch(rows, out_features, bias):
    from batchery.engine import fast_linear

    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, out_features, bias=bias)
    model = torch.nn.Sequential(lin)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        want = lin(x)
        assert fast_linear.install(model, max_rows=-1) == 1
        assert lin.weight.shape == (out_features, 96) and lin.weight.is_contiguous()  # kept; the kernel reads panels
        got = lin(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fast_linear_skips_what_it_cannot_run_and_keeps_a_tied_head_tied():
    from batchery.engine import fast_linear

    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight  # tied, as in most small LMs
    odd = torch.nn.Linear(32, 10)  # out_features not a multiple of 16: left to torch
    half = torch.nn.Linear(32, 16).to(torch.float16)  # fp16: left to torch
    model = torch.nn.ModuleList([emb, head, odd, half])
    ids = torch.tensor([3, 7, 63])
    with torch.inference_mode():
        want = head(emb(ids))
        assert fast_linear.install(model, max_rows=-1) == 1
        assert head.weight is emb.weight and emb.weight.is_contiguous()  # the kernel reads its own panel copy
        torch.testing.assert_close(head(emb(ids)), want, rtol=1e-5, atol=1e-5)
        assert not hasattr(odd, "_batchery_kernel") and not hasattr(half, "_batchery_kernel")
        assert fast_linear.install(model, max_rows=-1) == 0  # idempotent


def test_fast_linear_row_limit_routes_larger_inputs_to_torch():
    from batchery.engine import fast_linear

    lin = torch.nn.Linear(32, 32)
    x_small, x_big = torch.randn(4, 32), torch.randn(9, 32)
    with torch.inference_mode():
        want_small, want_big = lin(x_small), lin(x_big)
        assert fast_linear.install(torch.nn.Sequential(lin), max_rows=8) == 1
        torch.testing.assert_close(lin(x_small), want_small, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x_big), want_big, rtol=1e-5, atol=1e-5)
    assert fast_linear.calibrate(cpu_paged.load(), 64, 128) in (0, fast_linear.ANY, *fast_linear.CALIBRATION_ROWS)


@pytest.mark.parametrize("rows", [1, 6, 13, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_bf16_matches_torch(rows, bias):
    from batchery.engine import fast_linear

    if not cpu_paged.load().has_bf16_linear():
        pytest.skip("this CPU (or compiler) has no bf16 linear kernel (AVX2, AVX-512): bf16 linears stay on torch")
    torch.manual_seed(rows)
    lin = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(3, rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        want = lin(x).float()
        bias32 = None if lin.bias is None else lin.bias.float()
        exact = torch.nn.functional.linear(x.float(), lin.weight.float(), bias32)
        assert fast_linear.install(torch.nn.Sequential(lin), max_rows=-1) == 1
        got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # both round an fp32 accumulation to bf16 once: within one bf16 step of the exact result
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()
    assert (got.float() - want).abs().max() <= want.abs().max() * 2**-6


def _amx_kernel():
    kernel = cpu_paged.load()
    if kernel is None or not kernel.has_amx_linear():
        pytest.skip("this CPU (or compiler, or OS) has no AMX-BF16: bf16 linears take the vdpbf16ps kernel")
    return kernel


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_amx_matches_exact_sums(rows, bias):
    """Every row tail (a 16-row tile partly used, one or two row blocks, more than one 256-row chunk) and a
    weight of several column pairs and k tiles: within one bf16 rounding of the exact fp32 result."""
    kernel = _amx_kernel()
    g = torch.Generator().manual_seed(rows)
    n, k = 96, 160
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(2, rows, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    exact = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    got = kernel.linear_amx(x, kernel.pack_amx(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, n)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()


def test_linear_amx_refuses_what_it_cannot_run():
    kernel = _amx_kernel()
    with pytest.raises(RuntimeError, match="multiples of 32"):
        kernel.pack_amx(torch.zeros(48, 64, dtype=torch.bfloat16))
    tiles = kernel.pack_amx(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.linear_amx(torch.zeros(3, 64), tiles, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_amx(torch.zeros(3, 64, dtype=torch.bfloat16), tiles, torch.zeros(5, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 17, 33, 300])
def test_linear_amx_silu_equals_the_projections_and_fused_silu(rows):
    """The gate/up pass gives bit for bit what the two projections and cpu_fused's SiLU * up give (every row
    tail, two row chunks, inputs large enough for SiLU's saturation and a NaN
    in one gate column)."""
    kernel = _amx_kernel()
    gate, up, x = _gate_up_case(rows, inter=96, hidden=96, nan_col=3)
    want = kernel.fused_silu_mul(
        kernel.linear_amx(x, kernel.pack_amx(gate), None), kernel.linear_amx(x, kernel.pack_amx(up), None)
    )
    got = kernel.linear_amx_silu(x.view(1, rows, 96), kernel.pack_amx_gate_up(gate, up))
    _assert_gate_up(got, want, nan_col=3)


def _gate_up_case(rows: int, inter: int, hidden: int, nan_col: int):
    """gate, up [inter, hidden] and x [rows, hidden] in bf16, large enough for SiLU's saturation, with a NaN in gate
    column ``nan_col``. Row 0 of x has one nonzero input (64), the gates' first weights run from -0.8 to -0.6 and
    the ups' are 2^-70, so its gate sums are -51 to -38 and its up sums 2^-64, exact: SiLU(gate) * up is an fp32
    denormal in most columns (the rounding of denormals, which vcvtneps2bf16 would flush, must stay torch's)."""
    g = torch.Generator().manual_seed(rows)
    gate = (torch.randn(inter, hidden, generator=g) * 0.3).to(torch.bfloat16)
    up = (torch.randn(inter, hidden, generator=g) * 0.3).to(torch.bfloat16)
    gate[:, 0] = (-0.8 + 0.2 * torch.arange(inter) / inter).to(torch.bfloat16)
    up[:, 0] = 2.0**-70
    gate[nan_col, 5] = float("nan")
    x = (torch.randn(rows, hidden, generator=g) * 4).to(torch.bfloat16)
    x[0] = 0.0
    x[0, 0] = 64.0
    return gate, up, x


def _assert_gate_up(got: torch.Tensor, want: torch.Tensor, nan_col: int) -> None:
    """got [1, rows, inter] is bf16, NaN down column ``nan_col``, denormals in row 0, and bit for bit ``want``
    [rows, inter]."""
    rows, inter = want.shape
    assert got.shape == (1, rows, inter) and got.dtype == torch.bfloat16
    assert torch.isnan(got[0, :, nan_col]).all()
    row0 = got[0, 0].float().abs()
    assert int(((row0 > 0) & (row0 < 1.1754944e-38)).sum()) > inter // 4  # the denormal products are there
    assert torch.equal(got.view(rows, inter).view(torch.int16), want.view(torch.int16))


def test_pack_amx_gate_up_refuses_what_it_cannot_run():
    kernel = _amx_kernel()
    with pytest.raises(RuntimeError, match="one shape"):
        kernel.pack_amx_gate_up(torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16 and K of 32"):
        kernel.pack_amx_gate_up(torch.zeros(24, 64, dtype=torch.bfloat16), torch.zeros(24, 64, dtype=torch.bfloat16))
    tiles = kernel.pack_amx_gate_up(
        torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    )
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.linear_amx_silu(torch.zeros(3, 64), tiles)


def test_fast_linear_gives_amx_mlps_one_gate_up_pass():
    """install gives an MLP whose gate and up run on AMX the fused pass, and it computes what the MLP's own
    projections and SiLU compute, to bf16 rounding (torch's SiLU rounds as cpu_fused's does, up to exp's last bit)."""
    from batchery.engine import fast_linear

    _amx_kernel()

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(64, 96, bias=False)
            self.up_proj = torch.nn.Linear(64, 96, bias=False)

    torch.manual_seed(4)
    mlp = MLP().to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = (F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)).float()
        assert fast_linear.install(mlp, max_rows=-1, one_pass=True) == 2
        got = mlp._batchery_gate_up(x).float()
    assert (got - want).abs().max() <= want.abs().max() * 2**-6


def _silu_kernel():
    kernel = cpu_paged.load()
    if kernel is None or not kernel.has_bf16_silu():
        pytest.skip("this CPU (or compiler) has no AVX512-BF16: no vdpbf16ps gate/up pass")
    return kernel


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 17, 33, 300])
def test_linear_bf16_silu_equals_the_projections_and_fused_silu(rows):
    """The vdpbf16ps gate/up pass gives bit for bit what the two projections (linear_bf16) and cpu_fused's SiLU * up
    give: every row tail of the 6-row tile, several panels, inputs large enough for SiLU's saturation, a NaN in one
    gate column."""
    kernel = _silu_kernel()
    gate, up, x = _gate_up_case(rows, inter=160, hidden=96, nan_col=37)
    want = kernel.fused_silu_mul(
        kernel.linear_bf16(x, kernel.pack_bf16(gate), 160, None),
        kernel.linear_bf16(x, kernel.pack_bf16(up), 160, None),
    )
    got = kernel.linear_bf16_silu(x.view(1, rows, 96), kernel.pack_bf16_gate_up(gate, up))
    _assert_gate_up(got, want, nan_col=37)


def test_pack_bf16_gate_up_refuses_what_it_cannot_run():
    kernel = _silu_kernel()
    with pytest.raises(RuntimeError, match="one shape"):
        kernel.pack_bf16_gate_up(torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack_bf16_gate_up(torch.zeros(48, 64, dtype=torch.bfloat16), torch.zeros(48, 64, dtype=torch.bfloat16))
    packed = kernel.pack_bf16_gate_up(
        torch.zeros(32, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    )
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.linear_bf16_silu(torch.zeros(3, 64), packed)
    with pytest.raises(RuntimeError, match="bf16"):
        kernel.linear_bf16_silu(torch.zeros(3, 32, dtype=torch.bfloat16), packed)


@pytest.mark.parametrize("max_rows", [-1, 4])
def test_fast_linear_gives_bf16_mlps_one_gate_up_pass(max_rows):
    """install gives an MLP whose gate and up run on our bf16 kernel the one-pass gate/up (AMX or vdpbf16ps, as the
    CPU has), bit for bit the MLP's own projections and cpu_fused's SiLU * up, below and above the row limit the
    projections were routed with (above it, the projections and the separate SiLU)."""
    from batchery.engine import fast_linear

    kernel = cpu_paged.load()
    if not (kernel.has_bf16_silu() or kernel.has_amx_linear()):
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX-BF16")

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(64, 96, bias=False)
            self.up_proj = torch.nn.Linear(64, 96, bias=False)

    torch.manual_seed(4)
    mlp = MLP().to(torch.bfloat16)
    with torch.inference_mode():
        assert fast_linear.install(mlp, max_rows=max_rows, one_pass=True) == 2
        assert callable(getattr(mlp, "_batchery_gate_up", None))
        for rows in (1, 4, 7, 40):
            x = torch.randn(1, rows, 64).to(torch.bfloat16)
            want = kernel.fused_silu_mul(mlp.gate_proj(x).contiguous(), mlp.up_proj(x).contiguous())
            assert torch.equal(mlp._batchery_gate_up(x).view(torch.int16), want.view(torch.int16)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_rows", [-1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_fast_linear_gives_attention_one_qkv_pass(dtype, max_rows, bias):
    """install gives an attention module whose q, k and v projections run on our kernel one pass for the three, equal
    to the three projections column for column, below and above their row limit (above it, the three)."""
    from batchery.engine import fast_linear

    kernel = cpu_paged.load()
    if dtype == torch.bfloat16 and not kernel.has_bf16_linear():
        pytest.skip("no bf16 kernel on this CPU")

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(64, 96, bias=bias)
            self.k_proj = torch.nn.Linear(64, 32, bias=bias)
            self.v_proj = torch.nn.Linear(64, 32, bias=bias)

    torch.manual_seed(5)
    attn = Attn().to(dtype)
    with torch.inference_mode():
        assert fast_linear.install(attn, max_rows=max_rows, one_pass=True) == 3
        for rows in (1, 4, 7, 40):
            x = torch.randn(1, rows, 64).to(dtype)
            q, k, v = attn._batchery_qkv(x)
            assert q.shape == (1, rows, 96) and k.shape == v.shape == (1, rows, 32)
            for got, lin in zip((q, k, v), (attn.q_proj, attn.k_proj, attn.v_proj)):
                assert torch.equal(got, lin(x)), rows


def test_one_pass_projections_only_where_the_fused_layers_call_them():
    """The q/k/v and gate/up passes each hold one more copy of their weights, and only the fused decoder layers call
    them: a model without those layers gets none (unless asked), one with them gets both."""
    from batchery.engine import fast_linear

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n, bias=False) for n in (96, 32, 32))

    torch.manual_seed(6)
    plain = Block()
    assert fast_linear.install(plain, max_rows=-1) == 3
    assert not hasattr(plain, "_batchery_qkv")
    asked = Block()
    assert fast_linear.install(asked, max_rows=-1, one_pass=True) == 3
    assert callable(getattr(asked, "_batchery_qkv", None))


def test_fast_linear_bf16_takes_amx_where_the_cpu_has_it():
    """On AMX CPUs a bf16 layer whose sides are multiples of 32 runs on the tiles; one that is not keeps the
    vdpbf16ps kernel. Both give what torch gives, to bf16 rounding."""
    from batchery.engine import fast_linear

    kernel = _amx_kernel()
    torch.manual_seed(3)
    tiled, odd = torch.nn.Linear(64, 96).to(torch.bfloat16), torch.nn.Linear(48, 80).to(torch.bfloat16)
    assert fast_linear.uses_amx(kernel, tiled.weight) and not fast_linear.uses_amx(kernel, odd.weight)
    xa, xb = torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 48).to(torch.bfloat16)
    with torch.inference_mode():
        want_a, want_b = tiled(xa).float(), odd(xb).float()
        assert fast_linear.install(torch.nn.Sequential(tiled, odd), max_rows=-1) == 2
        got_a, got_b = tiled(xa).float(), odd(xb).float()
    assert (got_a - want_a).abs().max() <= want_a.abs().max() * 2**-6
    assert (got_b - want_b).abs().max() <= want_b.abs().max() * 2**-6


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_rounds_its_sums_as_torch_does(bias, amx):
    """The tiles write bf16 themselves: each fp32 sum (+ bias) must round exactly as ``.to(torch.bfloat16)``
    rounds it (to nearest, ties to even; a NaN as torch's vectorized conversion writes it). Inputs with two
    nonzero terms per row make every sum exact in fp32, so the expected output is known bit for bit; ties and
    values between bf16 steps are frequent."""
    kernel = _amx_kernel() if amx else cpu_paged.load()
    if not kernel.has_bf16_linear():
        pytest.skip("this CPU (or compiler) has no bf16 linear kernel (AVX2, AVX-512): bf16 linears stay on torch")
    g = torch.Generator().manual_seed(1)
    n, k, rows = (96 if amx else 80), 64, 13
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    w[5, 7] = float("nan")
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    cols = torch.randint(0, k, (rows, 2), generator=g)
    cols[:, 1] = (cols[:, 0] + 1 + torch.randint(0, k - 1, (rows,), generator=g)) % k  # two distinct columns
    cols[0] = torch.tensor([7, 8])  # row 0 reads the NaN weight in output 5 (still two terms)
    x[torch.arange(rows), cols[:, 0]] = 1.0
    x[torch.arange(rows), cols[:, 1]] = 2.0**-9  # far below 1 ulp of the first term: rounding decides
    b = (torch.randn(n, generator=g) * 2.0**-10).to(torch.bfloat16) if bias else None
    exact = x.float() @ w.float().t()
    if b is not None:
        exact = exact + b.float()
    want = exact.to(torch.bfloat16)
    got = kernel.linear_amx(x, kernel.pack_amx(w), b) if amx else kernel.linear_bf16(x, kernel.pack_bf16(w), n, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.isnan(got[0, 5])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the NaN's bits included
    assert (exact.to(torch.bfloat16).float() != exact).sum() > rows * n // 4  # the case really rounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy_and_skips_padding(dtype):
    """The C++ K/V store writes what ``torch_backend.store_kvcache`` (index_copy_) writes, skips slot -1,
    refuses a slot beyond the pool, and leaves every other slot as it was."""
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(9, 4, 3, 16, generator=g).to(dtype)
    vc = torch.randn(9, 4, 3, 16, generator=g).to(dtype)
    slots = torch.randperm(36, generator=g)[:20]
    key = torch.randn(20, 3, 16, generator=g).to(dtype)
    value = torch.randn(20, 3, 16, generator=g).to(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    torch_backend.store_kvcache(key, value, want_k, want_v, slots)
    got_k, got_v = kc.clone(), vc.clone()
    assert cpu_paged.store_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # as the attention layers pass it: a k_proj output [1, T, Hkv * D] seen as [1, Hkv, T, D], back to [T, Hkv, D]
    kt = key.reshape(1, 20, 48).view(1, 20, 3, 16).transpose(1, 2)[0].transpose(0, 1)
    got_k2, got_v2 = kc.clone(), vc.clone()
    assert cpu_paged.store_kv(kt, value, got_k2, got_v2, slots)
    assert torch.equal(got_k2, want_k)
    head_major = key.transpose(0, 1).contiguous().transpose(0, 1)  # a token's rows apart: torch stores it
    assert not cpu_paged.store_kv(head_major, value, kc.clone(), vc.clone(), slots)
    padded = slots.clone()
    padded[3] = -1
    got_k3, got_v3 = kc.clone(), vc.clone()
    assert cpu_paged.store_kv(key, value, got_k3, got_v3, padded)
    s3 = int(slots[3])
    assert torch.equal(got_k3.view(36, 3, 16)[s3], kc.view(36, 3, 16)[s3])  # padding wrote nothing
    keep = torch.ones(36, dtype=torch.bool)
    keep[s3] = False
    assert torch.equal(got_k3.view(36, 3, 16)[keep], want_k.view(36, 3, 16)[keep])
    assert not cpu_paged.store_kv(key, value, kc[:, :2], vc[:, :2], slots)  # a strided pool: torch stores it
    with pytest.raises(RuntimeError, match="beyond the pool"):
        cpu_paged.load().store_kv(key, value, kc.clone(), vc.clone(), slots + 36)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fast_linear_wide_fp32_reads_panels_and_keeps_a_tied_head_tied(rows):
    """An LM head (WIDE outputs or more; every fp32 layer is read in panels) is read in 64-column panels; its
    out_features need not be a multiple of 64 (the last panel is zero-padded), and a head tied to the embedding
    stays tied."""
    from batchery.engine import fast_linear

    torch.manual_seed(rows)
    n = fast_linear.WIDE + 48  # 64 * k + 48: a partial last panel
    emb = torch.nn.Embedding(n, 40)
    head = torch.nn.Linear(40, n, bias=False)
    head.weight = emb.weight
    x = torch.randn(rows, 40)
    ids = torch.tensor([0, n - 1])
    with torch.inference_mode():
        want, want_emb = head(x), emb(ids)
        assert fast_linear.install(torch.nn.ModuleList([emb, head]), max_rows=-1) == 1
        assert head.weight is emb.weight  # nothing untied: the kernel reads its own panel copy
        got = head(x)
        torch.testing.assert_close(emb(ids), want_emb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pack_panels_layout():
    """[N, K] -> [ceil(N / 64), K, 64]: panel p, row k, lane j holds w[64 p + j, k], zeros past N."""
    kernel = cpu_paged.load()
    w = torch.randn(80, 3)
    p = kernel.pack_panels(w)
    assert p.shape == (2, 3, 64)
    torch.testing.assert_close(p[0], w[:64].t())
    torch.testing.assert_close(p[1, :, :16], w[64:].t())
    assert (p[1, :, 16:] == 0).all()
    with pytest.raises(RuntimeError, match="pack_panels"):
        kernel.linear_panels(torch.randn(2, 3), p, 48, None)  # 48 outputs fit in one panel, not two


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 24, 64, 301])
@pytest.mark.parametrize("n", [16, 80, 192, 576])
def test_fp32_panels_give_the_transposed_reads_sums_bit_for_bit(rows, n):
    """Every routed fp32 layer reads panels (fast_linear._kernel_fn): the same tiles over the same k order as the
    transposed read, so the same bits, with and without bias (the fp32 greedy identity with HF rests on both), and
    a layer installed by fast_linear computes exactly that."""
    from batchery.engine import fast_linear

    kernel = cpu_paged.load()
    torch.manual_seed(rows * 1000 + n)
    w, b = torch.randn(n, 96), torch.randn(n)
    x = torch.randn(1, rows, 96)
    panels, wt = kernel.pack_panels(w), w.t().contiguous()
    for bias in (None, b):
        assert torch.equal(kernel.linear_panels(x, panels, n, bias), kernel.linear_t(x, wt, bias))
    lin = torch.nn.Linear(96, n)
    with torch.no_grad():
        lin.weight.copy_(w), lin.bias.copy_(b)
    with torch.inference_mode():
        assert fast_linear.install(torch.nn.Sequential(lin), max_rows=-1) == 1
        assert torch.equal(lin(x), kernel.linear_t(x, wt, b))
        assert torch.equal(lin.weight, w)  # the layer's own weight is kept as it was


def _load_in_subprocess(env: dict) -> dict:
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from batchery.engine import cpu_kernels\n"
        "m = cpu_kernels.load()\n"
        "print(json.dumps({'file': m.__file__, 'via_cpp_extension': 'torch.utils.cpp_extension' in sys.modules,"
        " 'marker': str(cpu_kernels._built_marker())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_built_extension_is_imported_without_cpp_extension(tmp_path):
    """The first load notes the built .so; the next process imports it directly (no setuptools, no ninja run);
    a note that no longer matches the file (rebuilt in place) is ignored and replaced."""
    import json
    import os

    # its own note directory; the build itself stays where it is (TORCH_EXTENSIONS_DIR follows XDG_CACHE_HOME)
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": ext}
    first = _load_in_subprocess(env)
    assert first["via_cpp_extension"]  # no note yet: load_inline found (or built) it
    marker = tmp_path / "batchery" / "kernels" / os.path.basename(first["marker"])
    assert json.loads(marker.read_text())["so"] == first["file"]
    second = _load_in_subprocess(env)
    assert second["file"] == first["file"] and not second["via_cpp_extension"]
    note = json.loads(marker.read_text())
    note["stat"][0] += 1  # as if the file were rebuilt since
    marker.write_text(json.dumps(note))
    third = _load_in_subprocess(env)
    assert third["via_cpp_extension"] and json.loads(marker.read_text())["stat"][0] == note["stat"][0] - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 1000, 49152])
def test_argmax_rows_matches_torch(dtype, vocab):
    """The sampler's greedy argmax: torch's ids exactly, ties to the first index, a NaN above everything (the first
    one), a row of -inf to 0; row lengths that are and are not multiples of the 16-lane vector."""
    from batchery.engine import cpu_kernels
    from batchery.engine.sampler import argmax_rows

    kernel = cpu_kernels.load()
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(37, vocab, generator=g).to(dtype)
    ties = torch.randint(0, 3, (37, vocab), generator=g).to(dtype)
    odd = x.clone()
    odd[3, vocab // 2] = float("nan")
    odd[3, vocab - 1] = float("nan")
    odd[4, :] = float("-inf")
    odd[5, vocab // 3] = float("inf")
    odd[6, :] = 0.0
    odd[6, vocab - 1] = -0.0
    for case in (x, ties, odd):
        want = case.argmax(dim=-1)
        assert torch.equal(kernel.argmax_rows(case), want)
        assert torch.equal(argmax_rows(case), want)
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))  # not contiguous: copied first
