"""The C++ CPU kernels against torch, on SmolLM2-135M shapes.

    python benchmarks/cpu_kernels.py [--seqs 64] [--context 240]

Prints (1) the paged decode kernel's time for one decode step (30 layers, 9 query / 3 KV heads,
head_dim 64) over a KV pool of randomly placed blocks, next to the torch reference (gather +
SDPA), and (2) the fp32 and bf16 linear kernels against ``F.linear`` (MKL / oneDNN) for the
model's 30 x 7 layer weights and its LM head, at several row counts."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from batchery.engine import cpu_kernels  # noqa: E402
from batchery.engine.attention import torch_backend  # noqa: E402
from batchery.engine.attention.metadata import AttentionMetadata  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB = 30, 9, 3, 64, 576, 1536, 49152


def timed(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def decode(kernel, dtype, seqs: int, context: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // block_size)
    num_blocks = seqs * per_seq
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    pools = [
        (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)) for _ in range(LAYERS)
    ]
    tables = torch.randperm(num_blocks, generator=g).view(seqs, per_seq)
    lens = torch.randint(context // 2, context + 1, (seqs,), generator=g)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(seqs, dtype=torch.long),
        num_decode_tokens=seqs,
        decode_block_tables=tables,
        decode_context_lens=lens,
        backend="torch",
    )
    ours = timed(lambda: [kernel.paged_decode(q, k, v, tables, lens, 0.125, 0, 0.0) for k, v in pools], 5)
    ref = timed(
        lambda: [torch_backend.paged_attention(q, None, None, k, v, md, 0.125, None, None) for k, v in pools], 3
    )
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * q.element_size() * LAYERS
    print(
        f"  {str(dtype).removeprefix('torch.'):9s} block {block_size:2d}: kernel {ours * 1e3:6.1f} ms "
        f"({kv_bytes / ours / 1e9:4.1f} GB/s of KV), torch gather+SDPA {ref * 1e3:6.1f} ms, {ref / ours:4.1f}x"
    )


def linear(kernel, rows_list, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [
        (HIDDEN, HIDDEN),
        (KV_HEADS * HEAD_DIM, HIDDEN),
        (KV_HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, HIDDEN),
        (FFN, HIDDEN),
        (FFN, HIDDEN),
        (HIDDEN, FFN),
    ] * LAYERS
    ws = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    head = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)
    from batchery.engine import fast_linear

    packed = [fast_linear._kernel_fn(kernel, w)[0] for w in ws]  # what install routes each layer to
    head_p = fast_linear._kernel_fn(kernel, head)[0]

    def ours(x, fn):
        return fn(x)

    for rows in rows_list:
        x = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (HIDDEN, FFN)}
        t_torch = timed(lambda x=x: [F.linear(x[w.shape[1]], w) for w in ws], 3)
        t_ours = timed(lambda x=x: [ours(x[w.shape[1]], p) for w, p in zip(ws, packed)], 3)
        h_torch = timed(lambda x=x: F.linear(x[HIDDEN], head), 3)
        h_ours = timed(lambda x=x: ours(x[HIDDEN], head_p), 3)
        print(
            f"  rows {rows:4d}: layers torch {t_torch * 1e3:6.1f} ms, ours {t_ours * 1e3:6.1f} ms "
            f"({t_torch / t_ours:4.2f}x) | LM head torch {h_torch * 1e3:5.1f} ms, ours {h_ours * 1e3:5.1f} ms "
            f"({h_torch / h_ours:4.2f}x)"
        )


def prefill(dtype, cases) -> None:
    """Prefill attention of one layer: the C++ kernel (cpu backend) against the torch path (SDPA per
    chunk, on the K/V gathered from the pool when a prefix was cached), timed in turns (best of 3 rounds).
    FLOPs: 4 * head_dim per (query head, query, visible key), the causal triangle counted once."""
    from batchery.engine.attention.metadata import PrefillSeq

    g = torch.Generator().manual_seed(0)
    bs = 16
    for seqs, q_len, context in cases:
        per_seq = -(-context // bs)
        num_blocks = seqs * per_seq
        shape = (num_blocks, bs, KV_HEADS, HEAD_DIM)
        kc, vc = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        tables = torch.randperm(num_blocks, generator=g).view(seqs, per_seq)
        tokens = seqs * q_len
        q = torch.randn(HEADS, tokens, HEAD_DIM, generator=g).to(dtype).transpose(0, 1)  # head-major, as in the model
        k = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        chunks = [PrefillSeq(i * q_len, q_len, context, None if q_len == context else tables[i]) for i in range(seqs)]
        args = (q, k, v, kc, vc)
        mds = {
            backend: AttentionMetadata(
                slot_mapping=torch.zeros(tokens, dtype=torch.long),
                num_decode_tokens=0,
                decode_block_tables=None,
                decode_context_lens=None,
                prefills=chunks,
                backend=backend,
            )
            for backend in ("cpu", "torch")
        }
        best = {"cpu": float("inf"), "torch": float("inf")}
        for _ in range(3):  # in turns: the load on the machine changes
            for backend, reps in (("cpu", 10), ("torch", 3)):
                step = mds[backend]
                t = timed(lambda a=args, md=step: torch_backend.paged_attention(*a, md, 0.125, None, None), reps)
                best[backend] = min(best[backend], t)
        ours, ref = best["cpu"], best["torch"]
        flops = seqs * HEADS * 4 * HEAD_DIM * sum(context - q_len + i + 1 for i in range(q_len))
        print(
            f"  {str(dtype).removeprefix('torch.'):9s} {seqs} x (q {q_len:4d}, context {context:4d}): "
            f"kernel {ours * 1e3:6.2f} ms ({flops / ours / 1e9:5.1f} GFLOP/s), "
            f"torch {ref * 1e3:6.2f} ms ({flops / ref / 1e9:5.1f} GFLOP/s), {ref / ours:4.2f}x"
        )


def fused(kernel, rows_list, dtype) -> None:
    """The elementwise work of SmolLM2's 30 decoder layers (two RMSNorms, two residual adds, the rotary
    embedding, SiLU * up): HF's torch code against the fused kernels (``batchery.engine.cpu_fused``)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(HIDDEN, eps=1e-5).to(dtype)
    w, eps = norm.weight, norm.variance_epsilon
    widths = dict(h=HIDDEN, o=HIDDEN, q=HEADS * HEAD_DIM, k=KV_HEADS * HEAD_DIM, gate=FFN, up=FFN, cos=HEAD_DIM)
    for rows in rows_list:
        t = {name: torch.randn(1, rows, n, generator=g).to(dtype) for name, n in widths.items()}
        t["sin"] = torch.randn(1, rows, HEAD_DIM, generator=g).to(dtype)

        def hf_layers(t=t, rows=rows):
            for _ in range(LAYERS):
                x = norm(t["h"])
                qs = t["q"].view(1, rows, HEADS, HEAD_DIM).transpose(1, 2)
                ks = t["k"].view(1, rows, KV_HEADS, HEAD_DIM).transpose(1, 2)
                apply_rotary_pos_emb(qs, ks, t["cos"], t["sin"])
                r = t["h"] + t["o"]
                x = norm(r)
                F.silu(t["gate"]) * t["up"]
                r + x

        def fused_layers(t=t):
            h, o, cos, sin = t["h"].clone(), t["o"].clone(), t["cos"][0].contiguous(), t["sin"][0].contiguous()
            for _ in range(LAYERS):
                kernel.fused_add_rms_norm(h, o, w, eps)
                kernel.fused_rope(t["q"], t["k"], cos, sin)
                kernel.fused_add_rms_norm(h, o, w, eps)
                kernel.fused_silu_mul(t["gate"], t["up"])

        with torch.inference_mode():
            t_hf, t_ours = timed(hf_layers, 5), timed(fused_layers, 5)
        print(
            f"  {str(dtype).removeprefix('torch.'):9s} rows {rows:4d}: HF's torch ops {t_hf * 1e3:7.2f} ms, "
            f"fused {t_ours * 1e3:6.2f} ms ({t_hf / t_ours:4.1f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--rows", default="1,8,32,64,256")
    args = ap.parse_args()
    kernel = cpu_kernels.load()
    if kernel is None:
        sys.exit("the CPU kernels could not be built here (see the log above)")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"decode attention, one step of {args.seqs} sequences, context up to {args.context}:")
    for dtype in (torch.float32, torch.bfloat16):
        for bs in (8, 16):
            decode(kernel, dtype, args.seqs, args.context, bs)
    rows = [int(r) for r in args.rows.split(",")]
    print("fp32 linear, SmolLM2-135M weights (torch: MKL):")
    linear(kernel, rows, torch.float32)
    if kernel.has_bf16_linear():
        print("bf16 linear, SmolLM2-135M weights (torch: oneDNN):")
        linear(kernel, rows, torch.bfloat16)
    else:
        print("bf16 linear: this CPU or compiler has no AVX512-BF16, torch keeps bf16 linears")
    if kernel.has_prefill_attention():
        print("prefill attention, one layer (9 query / 3 KV heads, head_dim 64, block 16):")
        for dtype in (torch.float32, torch.bfloat16):
            prefill(dtype, [(1, 512, 512), (1, 32, 640), (8, 48, 648), (1, 1024, 1024)])
    else:
        print("prefill attention: this CPU or compiler has no AVX-512, torch keeps prefill")
    print("decoder-layer elementwise ops, 30 layers (norms, residual adds, rotary, SiLU * up):")
    for dtype in (torch.float32, torch.bfloat16):
        fused(kernel, rows, dtype)


if __name__ == "__main__":
    main()
