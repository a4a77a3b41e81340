"""One-call GPU check (see benchmarks/gpu_check.sh): Triton kernel correctness, decode CUDA graphs
against eager steps, engine vs HF static batching on the reference workload shape, and the 1B decode
step against the HBM bound (with CUDA graphs, and eager for comparison).

Uses random-weight models built from configs (no downloads, no tokenizer): the SmolLM2-135M shape
and a Llama ~1B shape, both bf16. Needs only torch, transformers and triton."""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import reference_requests  # noqa: E402

from batchery.engine.config import EngineConfig  # noqa: E402
from batchery.engine.llm_engine import LLMEngine  # noqa: E402
from batchery.engine.loader import LoadedModel  # noqa: E402
from batchery.engine.sampling import SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.3e12


def build(shape: str, device: torch.device) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "smollm2-135m":
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_theta=100000.0,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.requires_grad_(False)
    return LoadedModel(model, None, cfg, torch.bfloat16, device, shape)


def check_kernels(device) -> bool:
    from batchery.engine.attention import triton_attention as ta

    ok = True
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 1e-2)):
        for bs, hkv, grp, d, window, cap in (
            (16, 3, 3, 64, None, None),
            (16, 8, 4, 128, 64, None),
            (32, 2, 2, 128, None, 30.0),
            (16, 4, 2, 64, 100, 50.0),
        ):
            nb, nseq = 256, 6
            kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(device)
            vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype).to(device)
            ctx = torch.tensor([1, 17, 100, 257, 513, 900], dtype=torch.int32)
            width = int((ctx.max() + bs - 1) // bs)
            perm = torch.randperm(nb, generator=g)
            tables = torch.zeros(nseq, width, dtype=torch.int32)
            used = 0
            for i, n in enumerate(ctx.tolist()):
                k = -(-n // bs)
                tables[i, :k] = perm[used : used + k]
                used += k
            tables, ctx_d = tables.to(device), ctx.to(device)
            q = torch.randn(nseq, hkv * grp, d, generator=g).to(dtype).to(device)
            scale = d**-0.5
            got = ta.paged_decode_attention(q, kc, vc, tables, ctx_d, scale, window, cap)
            ref = ta.ref_paged_decode_attention(q, kc, vc, tables, ctx_d, scale, window, cap)
            err_d = (got.float() - ref.float()).abs().max().item()
            qlens = torch.tensor([1, 5, 50, 10, 200, 64], dtype=torch.int32)
            cu = torch.zeros(nseq + 1, dtype=torch.int32)
            cu[1:] = qlens.cumsum(0)
            qp = torch.randn(int(cu[-1]), hkv * grp, d, generator=g).to(dtype).to(device)
            got = ta.paged_prefill_attention(qp, kc, vc, tables, cu.to(device), ctx_d, scale, window, cap)
            ref = ta.ref_paged_prefill_attention(qp, kc, vc, tables, cu.to(device), ctx_d, scale, window, cap)
            err_p = (got.float() - ref.float()).abs().max().item()
            good = err_d < tol and err_p < tol
            ok &= good
            print(
                f"  {str(dtype):15s} bs={bs:2d} hkv={hkv} gqa={grp} d={d:3d} window={window} softcap={cap}: "
                f"decode err {err_d:.2e}, prefill err {err_p:.2e} {'ok' if good else 'FAIL'}"
            )
    return ok


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    reqs = reference_requests(n, seed)
    # ~1.25 tokens per word plus the chat template, as SmolLM2's tokenizer gives on this workload
    prompts = [
        [rng.randrange(100, 40000) for _ in range(35 + int(1.25 * len(m[0]["content"].split())))] for m, _ in reqs
    ]
    return prompts, [mt for _, mt in reqs]


def engine_tps(loaded, prompts, max_tokens, **kw) -> tuple[float, dict]:
    eng = LLMEngine(EngineConfig(model=loaded.name, dtype="bfloat16", **kw), loaded=loaded)
    eng.add_request("warm", prompts[0], SamplingParams(max_tokens=4, temperature=0))
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    return sum(max_tokens) / (time.perf_counter() - t0), eng.stats()


@torch.inference_mode()
def hf_static_tps(loaded, prompts, max_tokens, batch_size=64) -> float:
    model = loaded.model
    model.set_attn_implementation("sdpa")
    dev = loaded.device
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, mts = prompts[b : b + batch_size], max_tokens[b : b + batch_size]
        w = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (w - len(p)) + p for p in batch], device=dev)
        mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in batch], device=dev)
        n = max(mts)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    torch.cuda.synchronize()
    return sum(max_tokens) / (time.perf_counter() - t0)


def check_graphs(loaded, n=37) -> bool:
    """One decode step of ``n`` sequences (padded to a bucket) replayed from its CUDA graph, against
    the same step run eagerly: the logits must agree."""
    eng = LLMEngine(EngineConfig(model=loaded.name, dtype="bfloat16", max_num_seqs=64), loaded=loaded)
    runner = eng.runner
    if runner.graphs is None:
        print("  no CUDA graphs were captured (see the log above)")
        return False
    rng = random.Random(1)
    for i in range(n):
        eng.add_request(
            str(i),
            [rng.randrange(100, 40000) for _ in range(20 + i)],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()  # the prompts, and each one's first token
    step = eng.scheduler.schedule()  # the next step: one decode token for each sequence
    assert len(step.seqs) == n and set(step.num_new_tokens) == {1}, step.num_new_tokens
    p = runner.pack(step.seqs, step.num_new_tokens)
    got = runner.graphs.run(p).float().clone()
    ids, pos, keep, md, _ = runner.prepare(p)
    ref = runner.forward(ids, pos, keep, md).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    good = err < 2e-2
    print(
        f"  {len(runner.graphs.graphs)} graphs (batch {runner.graphs.sizes[0]}..{runner.graphs.max_size}); "
        f"{n} sequences: max logit difference {err:.1e} of the largest, argmax agrees on {100 * same:.0f}% "
        f"{'ok' if good else 'FAIL'}"
    )
    return good


def decode_step(loaded, batch=256, context=512, steps=20, cuda_graphs=True) -> tuple[float, float, bool]:
    eng = LLMEngine(
        EngineConfig(
            model=loaded.name,
            dtype="bfloat16",
            max_num_seqs=batch,
            max_num_batched_tokens=16384,
            cuda_graphs=cuda_graphs,
        ),
        loaded=loaded,
    )
    rng = random.Random(0)
    for i in range(batch):
        eng.add_request(
            str(i),
            [rng.randrange(100, 100000) for _ in range(context)],
            SamplingParams(temperature=0, max_tokens=steps + 50, ignore_eos=True),
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    cfg = loaded.hf_config
    params = sum(p.numel() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ctx = context + 3 + steps // 2
    kv_bytes = 2 * cfg.num_hidden_layers * batch * ctx * cfg.num_key_value_heads * head_dim * 2
    bound = (params * 2 + kv_bytes) / HBM_BYTES_PER_S
    graphs = eng.runner.graphs is not None
    del eng
    torch.cuda.empty_cache()
    return dt, bound, graphs


def section(title: str, fn, results: dict) -> None:
    """Run one part of the check; a failure is printed and recorded, and the next part still runs,
    so one run on a lent machine reports everything it can."""
    print(title, flush=True)
    t0 = time.perf_counter()
    try:
        ok = fn()
    except Exception:
        print("  FAILED with an exception:")
        print("    " + traceback.format_exc().strip().replace("\n", "\n    "))
        ok = False
    results[title] = ok
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")
    logging.getLogger("batchery.engine.graphs").setLevel(logging.INFO)
    dev = torch.device("cuda")
    t_start = time.perf_counter()
    import transformers
    import triton

    print(
        f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, triton {triton.__version__}"
    )
    results: dict[str, bool] = {}
    section("1. Triton kernels against the torch reference", lambda: check_kernels(dev), results)

    small = build("smollm2-135m", dev)
    section(
        "2. Decode CUDA graphs against eager steps, SmolLM2-135M shape, bf16", lambda m=small: check_graphs(m), results
    )

    def throughput(small: LoadedModel = small) -> bool:
        prompts, max_tokens = workload(args.requests)
        eng, st = engine_tps(small, prompts, max_tokens, max_num_seqs=512, max_num_batched_tokens=8192)
        print(
            f"  engine     {eng:10.1f} generated tok/s (mean batch {st['mean_batch_size']:.0f} seqs, "
            f"{st['cuda_graph_steps']} of {st['num_steps']} steps from CUDA graphs)",
            flush=True,
        )
        hf = hf_static_tps(small, prompts, max_tokens)
        print(f"  HF static  {hf:10.1f} generated tok/s (batch 64)")
        print(f"  ratio      {eng / hf:10.2f}x  (target >= 8x)")
        return eng / hf >= 8

    section(
        f"3. {args.requests} chat requests of the reference workload shape, SmolLM2-135M shape, bf16",
        throughput,
        results,
    )
    del small, throughput  # the default argument holds the model too
    torch.cuda.empty_cache()

    def decode() -> bool:
        big = build("llama-1b", dev)
        dt, bound, graphs = decode_step(big)
        print(
            f"  decode step {dt * 1e3:8.2f} ms ({'CUDA graphs' if graphs else 'eager: no graphs'}); "
            f"HBM bound {bound * 1e3:.2f} ms (4.3 TB/s); ratio {dt / bound:.2f}x (target <= 2x)",
            flush=True,
        )
        dt_eager, _, _ = decode_step(big, cuda_graphs=False)
        print(f"  decode step {dt_eager * 1e3:8.2f} ms eager (cuda_graphs=False): graphs {dt_eager / dt:.2f}x faster")
        return dt / bound <= 2

    section("4. Llama ~1B shape, bf16: decode step at batch 256", decode, results)
    print(f"gpu_check: {time.perf_counter() - t_start:.0f} s in all")
    for title, ok in results.items():
        print(f"  {'ok  ' if ok else 'MISS'} {title}")
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
