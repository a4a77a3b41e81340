"""One-call GPU check (see benchmarks/gpu_check.sh): correctness of the GPU path end to end, and the
figures the README reports.

Each section runs in a subprocess of its own, so an illegal address (which poisons a CUDA context
for good) fails only that section, and the table names it; the kernel section runs with
``CUDA_LAUNCH_BLOCKING=1`` so a fault is reported at the launch that caused it.

1. ``kernels``: ``store_kvcache`` against a reference store (``index_copy_``, padding slots
   included); paged decode (split and ``num_splits=1``, contexts far shorter than the table width)
   and varlen prefill (cached prefix) against the dense torch reference; bf16, fp16 and fp32.
2. ``bigpool``: one KV pool of more than 2^31 elements, its highest blocks stored and attended
   (on the CPU dry run a small pool through the same code, highest blocks included).
3. ``logits``: the engine's logprobs (decode graphs on and off, fp32 and bf16, chunked prefill,
   prefix-cache hits, mixed steps) against HF ``sdpa`` teacher-forced on the engine's own tokens.
   A wrong slot mapping or stride fails here, which a graph-versus-eager comparison cannot see.
4. ``throughput``: the engine against HF static batching on the reference workload shape; both warm
   up on a slice of the workload first, so Triton compiles outside the timed region.
5. ``decode``: the Llama ~1B decode step at batch 256 against the HBM bound, graphs on and off;
   host time beside device time from CUDA events (and the graph replay alone).

Models are random-weight, built from configs (no downloads, no tokenizer, no gguf): the
SmolLM2-135M shape and a Llama ~1B shape. Needs only torch, transformers and triton.

``--dry-run`` runs every section's code path on the CPU with tiny sizes (Triton under
``TRITON_INTERPRET=1``); ``--inject-slot-bug`` swaps every stored slot with its neighbour (an
off-by-one in the slot mapping) to show that the checks catch it."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULT_TAG = "@@gpu_check "
HBM_BYTES_PER_S = 4.3e12  # H200

# name -> (title, cap in seconds on a GPU, cap in the dry run)
SECTIONS: dict[str, tuple[str, int, int]] = {
    "kernels": ("Triton kernels and store_kvcache against references (CUDA_LAUNCH_BLOCKING=1)", 150, 120),
    "bigpool": ("A KV pool over 2^31 elements, its highest blocks", 90, 60),
    "logits": ("Engine logprobs against HF sdpa, teacher-forced (graphs on/off, fp32/bf16)", 180, 90),
    "throughput": ("Engine against HF static batching, reference workload shape", 180, 90),
    "decode": ("Llama ~1B shape decode step at batch 256 against the HBM bound", 180, 90),
}


# ================================================================================================
# The parent: runs each section in a subprocess and prints the table
# ================================================================================================


_CURRENT: list[subprocess.Popen] = []  # the section's process now running (its own session)


def _stop(signum: int, frame: object) -> None:
    """``timeout`` in gpu_check.sh (or ^C) ends the parent: the running section goes with it, so no
    orphan keeps the GPU."""
    for proc in _CURRENT:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"\ngpu_check: stopped by signal {signum}", flush=True)
    os._exit(124)


def _run_section(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One section in a fresh interpreter (its own CUDA context); its output is streamed, indented."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"  # before triton is imported in the child
        env["CUDA_VISIBLE_DEVICES"] = ""
    if name == "kernels":
        env["CUDA_LAUNCH_BLOCKING"] = "1"  # a fault is reported at the launch that caused it
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--requests", str(args.requests)]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.inject_slot_bug:
        cmd.append("--inject-slot-bug")
    if args.inject_crash:
        cmd += ["--inject-crash", args.inject_crash]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    _CURRENT[:] = [proc]
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not line.startswith(RESULT_TAG):
                print("  " + line.rstrip("\n"), flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and anything it started
        proc.wait()
    reader.join(timeout=5)
    _CURRENT.clear()
    wall = time.perf_counter() - t0
    result: dict[str, Any] | None = None
    for line in lines:
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
    if timed_out:
        return {"status": "TIMEOUT", "detail": f"killed after {timeout:.0f} s", "wall": wall, "figures": {}}
    if result is None:
        rc = proc.returncode
        how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        return {"status": "CRASH", "detail": f"{how}, no result (see its output above)", "wall": wall, "figures": {}}
    result["wall"] = wall
    return result


def parent(args: argparse.Namespace) -> int:
    names = list(SECTIONS) if not args.sections else [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        sys.exit(f"gpu_check: unknown section(s) {unknown}; known: {list(SECTIONS)}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device (run with --dry-run for the CPU dry run)")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t_start = time.perf_counter()
    mode = "dry run on the CPU (TRITON_INTERPRET=1, tiny sizes)" if args.dry_run else "CUDA"
    bug = " with the slot bug injected" if args.inject_slot_bug else ""
    print(f"gpu_check: {mode}{bug}; sections {', '.join(names)}; budget {args.budget:.0f} s", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        title, cap_gpu, cap_dry = SECTIONS[name]
        cap = cap_dry if args.dry_run else cap_gpu
        left = args.budget - (time.perf_counter() - t_start)
        reserve = sum(min(SECTIONS[n][2 if args.dry_run else 1], 40) for n in names[i + 1 :])
        timeout = max(20.0, min(cap, left - reserve))
        print(f"\n[{i + 1}/{len(names)}] {name}: {title} (limit {timeout:.0f} s)", flush=True)
        results[name] = _run_section(name, args, timeout)
        r = results[name]
        print(f"  -> {r['status']} in {r['wall']:.1f} s" + (f": {r['detail']}" if r.get("detail") else ""), flush=True)

    print(f"\ngpu_check: {time.perf_counter() - t_start:.0f} s in all{bug}")
    print(f"  {'section':<11} {'status':<8} {'time':>7}  detail")
    for name, r in results.items():
        failed = [c for c, ok in r.get("checks", []) if not ok]
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        detail = r.get("detail") or ("failed: " + "; ".join(failed[:3]) + more if failed else SECTIONS[name][0])
        print(f"  {name:<11} {r['status']:<8} {r['wall']:6.1f}s  {detail}")
    fig = {k: v for r in results.values() for k, v in r.get("figures", {}).items()}
    if fig:
        print("\nfigures" + (" (dry run: tiny sizes on the CPU, not figures for the README)" if args.dry_run else ""))
        for k, v in fig.items():
            print(f"  {k:<34} {v}")
    return 0 if all(r["status"] == "PASS" for r in results.values()) else 1


# ================================================================================================
# The child: one section
# ================================================================================================


class Ctx:
    """What a section needs: the device, the mode, and where its checks and figures go."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.dry = bool(args.dry_run)
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.checks: list[tuple[str, bool]] = []
        self.figures: dict[str, Any] = {}
        self.miss = False  # a figure missed its target (the code ran correctly)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append((name, bool(ok)))
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def run(self, name: str, fn: Callable[..., None], *fn_args: Any) -> None:
        """One sub-check; an exception fails it by name. A CUDA error leaves the context unusable,
        so it ends the section (the parent's next section gets a fresh one)."""
        try:
            fn(*fn_args)
            self.sync()  # an asynchronous fault surfaces here, under this sub-check's name
        except Exception as e:
            self.check(name, False, "raised " + traceback.format_exc().strip().replace("\n", "\n      "))
            if "CUDA" in str(e) or "cuda" in type(e).__name__.lower():
                raise


def _patch_interpreter() -> None:
    """Works around triton-lang/triton#9171 in the CPU interpreter (as tests/test_triton_kernels.py
    does): with numpy >= 2.4 the triton 3.6 interpreter cannot use a loaded scalar as a ``range``
    bound; the upstream fix converts through ``reshape(-1)[0]``."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


def _inject_slot_bug() -> None:
    """Every slot handed to the KV store swapped with its neighbour (``s ^ 1``; padding slots stay
    -1): an off-by-one in the slot mapping that never leaves the block (so it cannot fault). The
    store and the attention reads stay consistent with each other only where the bug hides."""
    import torch

    from batchery.engine.attention import triton_attention as ta
    from batchery.engine.attention import triton_backend as tb

    original = ta.store_kvcache

    def buggy(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
        original(key, value, k_cache, v_cache, torch.where(slot_mapping >= 0, slot_mapping ^ 1, slot_mapping))

    ta.store_kvcache = buggy
    tb.store_kvcache = buggy
    print("  (slot bug injected: every stored slot s goes to s ^ 1)", flush=True)


# ------------------------------------------------------------------------------------------------
# 1, 2: kernels
# ------------------------------------------------------------------------------------------------

TOL = {"torch.float32": 1e-4, "torch.float16": 1e-2, "torch.bfloat16": 3e-2}


def _store_check(c: Ctx, dtype: Any, num_blocks: int, bs: int, hkv: int, d: int, first_block: int, gen: Any) -> None:
    """Stores into blocks ``first_block..num_blocks-1`` (all their slots, shuffled, every fifth token
    a padding slot -1, key/value non-contiguous as the model hands them) and compares the pool with
    ``index_copy_`` into a reference of that region; the rest of the pool must stay untouched."""
    import torch

    from batchery.engine.attention import triton_attention as ta

    dev = c.device
    kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    region = num_blocks - first_block
    local = torch.randperm(region * bs, generator=gen)
    slots = (local + first_block * bs).to(dev)
    pad = torch.arange(len(slots), device=dev) % 5 == 3
    slots = torch.where(pad, torch.full_like(slots, -1), slots)
    n = len(slots)
    # [heads, tokens, dim] transposed to [tokens, heads, dim], as the attention function's views are
    key = torch.randn(hkv, n, d, generator=gen).to(dtype).to(dev).transpose(0, 1)
    value = torch.randn(hkv, n, d, generator=gen).to(dtype).to(dev).transpose(0, 1)
    ta.store_kvcache(key, value, kc, vc, slots)
    keep = slots >= 0
    ref_k = torch.zeros(region * bs, hkv, d, dtype=dtype, device=dev)
    ref_v = torch.zeros_like(ref_k)
    ref_k.index_copy_(0, slots[keep] - first_block * bs, key[keep])
    ref_v.index_copy_(0, slots[keep] - first_block * bs, value[keep])
    same = torch.equal(kc[first_block:].reshape(-1, hkv, d), ref_k) and torch.equal(
        vc[first_block:].reshape(-1, hkv, d), ref_v
    )
    outside = int(kc[:first_block].count_nonzero()) + int(vc[:first_block].count_nonzero()) if first_block else 0
    c.check(
        f"store_kvcache {str(dtype)[6:]} [{num_blocks}, {bs}, {hkv}, {d}] blocks {first_block}..{num_blocks - 1}",
        same and outside == 0,
        f"{n} tokens ({int(pad.sum())} padding) against index_copy_: "
        f"{'identical' if same else 'DIFFERENT'}, {outside} elements written outside the region",
    )


def _tables(ctx: list[int], bs: int, width: int, blocks: list[int]) -> Any:
    import torch

    tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(ctx):
        k = -(-n // bs)
        tables[i, :k] = torch.tensor(blocks[used : used + k], dtype=torch.int32)
        used += k
    assert used <= len(blocks), "not enough blocks for the contexts"
    return tables


def _attention_checks(
    c: Ctx,
    label: str,
    kc: Any,
    vc: Any,
    ctx: list[int],
    qlens: list[int],
    width: int,
    blocks: list[int],
    grp: int,
    window: int | None,
    cap: float | None,
    gen: Any,
) -> None:
    """Decode (auto splits, ``num_splits=1``, 3 forced splits) and prefill against the references."""
    import torch

    from batchery.engine.attention import triton_attention as ta

    dev, dtype = c.device, kc.dtype
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    tol = TOL[str(dtype)]
    tables = _tables(ctx, bs, width, blocks).to(dev)
    ctx_d = torch.tensor(ctx, dtype=torch.int32, device=dev)
    scale = d**-0.5
    q = torch.randn(len(ctx), hkv * grp, d, generator=gen).to(dtype).to(dev)
    ref = ta.ref_paged_decode_attention(q, kc, vc, tables, ctx_d, scale, window, cap).float()
    for splits in (None, 1, 3):
        got = ta.paged_decode_attention(q, kc, vc, tables, ctx_d, scale, window, cap, num_splits=splits)
        err = (got.float() - ref).abs().max().item()
        c.check(
            f"decode {label} splits={splits or 'auto'}",
            err < tol,
            f"contexts {min(ctx)}..{max(ctx)} in a table of {width * bs} positions: max error {err:.1e}",
        )
    cu = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(qlens).cumsum(0)
    qp = torch.randn(int(cu[-1]), hkv * grp, d, generator=gen).to(dtype).to(dev)
    cu = cu.to(dev)
    got = ta.paged_prefill_attention(qp, kc, vc, tables, cu, ctx_d, scale, window, cap, max_seqlen_q=max(qlens))
    ref = ta.ref_paged_prefill_attention(qp, kc, vc, tables, cu, ctx_d, scale, window, cap).float()
    err = (got.float() - ref).abs().max().item()
    c.check(f"prefill {label}", err < tol, f"queries {qlens}, contexts {ctx} (cached prefixes): max error {err:.1e}")


def _dtypes(c: Ctx) -> list[Any]:
    """All three on a GPU. On the CPU the interpreter computes ``tl.dot`` on 16-bit types wrongly
    (tests/test_triton_kernels.py probes and skips them too): the dry run stores bf16 (no dot) but
    attends in fp32 only."""
    import torch

    if not c.dry:
        return [torch.bfloat16, torch.float16, torch.float32]
    return [torch.float32, torch.bfloat16]


def _attends(c: Ctx, dtype: Any) -> bool:
    import torch

    return not c.dry or dtype == torch.float32


def sec_kernels(c: Ctx) -> None:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    if c.dry:
        shapes = [(8, 2, 2, 32, None, None), (16, 1, 4, 32, 20, 30.0)]
        ctx, qlens, nb, width_pos = [0, 1, 9, 30, 50], [0, 1, 5, 30, 12], 20, 256
    else:
        shapes = [(16, 3, 3, 64, None, None), (16, 8, 4, 128, 64, None), (32, 2, 2, 128, None, 30.0)]
        shapes.append((16, 4, 2, 64, 100, 50.0))
        ctx, qlens, nb, width_pos = [0, 1, 17, 100, 257, 900, 513], [0, 1, 5, 50, 10, 200, 64], 256, 8192
    for dtype in _dtypes(c):
        for bs, hkv, grp, d, window, cap in shapes:
            label = f"{str(dtype)[6:]} bs={bs} hkv={hkv} gqa={grp} d={d} window={window} softcap={cap}"
            c.run(f"store {label}", _store_check, c, dtype, nb, bs, hkv, d, 0, gen)
            if _attends(c, dtype):
                kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(c.device)
                vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(c.device)
                blocks = torch.randperm(nb, generator=gen).tolist()
                args = (kc, vc, ctx, qlens, width_pos // bs, blocks, grp, window, cap, gen)
                c.run(label, _attention_checks, c, label, *args)


def sec_bigpool(c: Ctx) -> None:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1)
    dtype = torch.float32 if c.dry else torch.bfloat16  # the interpreter's 16-bit tl.dot is wrong (see _dtypes)
    if c.dry:
        bs, hkv, grp, d, top = 8, 2, 2, 32, 12
        num_blocks = 64
        ctx, qlens = [1, 20, 40], [1, 4, 16]
    else:
        bs, hkv, grp, d, top = 16, 8, 4, 128, 112
        num_blocks = 2**31 // (bs * hkv * d) + 64  # each of K and V: more than 2^31 elements
        ctx, qlens = [1, 300, 700, 500], [1, 7, 100, 64]
    elems = num_blocks * bs * hkv * d
    print(
        f"  pool of {num_blocks} blocks x {bs} x {hkv} x {d}: {elems} elements per cache "
        f"({'over' if elems > 2**31 else 'under'} 2^31 = {2**31}; {elems * 2 / 2**30:.2f} GiB each of K and V)"
    )
    first = num_blocks - top
    c.run("store, highest blocks", _store_check, c, dtype, num_blocks, bs, hkv, d, first, gen)
    gc.collect()
    if c.device.type == "cuda":
        torch.cuda.empty_cache()

    def attend() -> None:
        kc = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=c.device)
        vc = torch.zeros_like(kc)
        kc[first:] = torch.randn(top, bs, hkv, d, generator=gen).to(dtype).to(c.device)
        vc[first:] = torch.randn(top, bs, hkv, d, generator=gen).to(dtype).to(c.device)
        blocks = (torch.randperm(top, generator=gen) + first).tolist()  # only the highest blocks
        width = -(-max(ctx) // bs) + 4
        _attention_checks(
            c, f"{str(dtype)[6:]} at blocks >= {first}", kc, vc, ctx, qlens, width, blocks, grp, None, None, gen
        )

    c.run("attention, highest blocks", attend)


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def build(shape: str, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchery.engine.loader import LoadedModel

    common = dict(max_position_embeddings=8192, tie_word_embeddings=True)
    if shape == "tiny":
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,  # the interpreter pays ~0.1 s a kernel launch: one layer keeps the dry run short
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            **common,
        )
    elif shape == "smollm2-135m":
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=100000.0,
            **common,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
            **common,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return LoadedModel(model, None, cfg, dtype, device, shape)


def _engine(c: Ctx, loaded: Any, graphs: bool, **kw: Any) -> Any:
    """An engine on ``loaded`` with the Triton backend; ``graphs`` on the CPU dry run runs the decode
    graphs' static-buffer path without capture (what the graphs replay on a GPU)."""
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine

    gc.collect()  # a dropped engine's KV pool goes before the next one is sized
    dtype = str(loaded.dtype).removeprefix("torch.")
    eng = LLMEngine(
        EngineConfig(model=loaded.name, dtype=dtype, attention_backend="triton", cuda_graphs=graphs, **kw),
        loaded=loaded,
    )
    if graphs and c.dry and eng.runner.graphs is None:
        eng.runner.graphs = eng.runner.build_decode_graphs(capture=False)
    if graphs and eng.runner.graphs is None:
        raise RuntimeError("no decode CUDA graphs were captured (see the log above)")
    return eng


def _drain(eng: Any, outs: dict[str, Any] | None = None) -> None:
    while eng.has_unfinished():
        for o in eng.step():
            if outs is not None:
                outs[o.request_id] = o


# ------------------------------------------------------------------------------------------------
# 3: engine logprobs against HF sdpa, teacher-forced
# ------------------------------------------------------------------------------------------------


def _engine_logprobs(c: Ctx, loaded: Any, graphs: bool, prompts: list[list[int]], max_tokens: int) -> tuple:
    """Greedy runs with logprobs: half the prompts first, the rest two steps later (mixed steps),
    chunked prefill, prefix-cache hits on the shared prefix. Returns the outputs in prompt order."""
    from batchery.engine.sampling import SamplingParams

    kw = dict(max_num_seqs=16, max_num_batched_tokens=32 if c.dry else 256, num_kv_blocks=128 if c.dry else 4096)
    eng = _engine(c, loaded, graphs, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs: dict[str, Any] = {}
    half = len(prompts) // 2
    for i in range(half):
        eng.add_request(str(i), prompts[i], params)
    for _ in range(2):
        for o in eng.step():
            outs[o.request_id] = o
    for i in range(half, len(prompts)):
        eng.add_request(str(i), prompts[i], params)
    _drain(eng, outs)
    st = eng.stats()
    del eng
    return [outs[str(i)] for i in range(len(prompts))], st


def _hf_logprobs(loaded: Any, prompt: list[int], tokens: list[int]) -> Any:
    """HF sdpa on prompt + generated tokens at once: [len(tokens), vocab] log-softmax rows, row j the
    distribution that generated token j came from."""
    import torch

    ids = torch.tensor([prompt + tokens[:-1]], device=loaded.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1 :]


def _logits_run(
    c: Ctx, loaded: Any, graphs: bool, prompts: list[list[int]], max_tokens: int, name: str, runs: dict
) -> None:
    outs, st = _engine_logprobs(c, loaded, graphs, prompts, max_tokens)
    runs[graphs] = outs
    if graphs:
        c.check(
            f"{name} graphs used",
            st["cuda_graph_steps"] > 0,
            f"{st['cuda_graph_steps']} of {st['num_steps']} steps through the decode graphs"
            + (" (static buffers, no capture: CPU)" if c.dry else ""),
        )
    c.check(
        f"{name} graphs={'on' if graphs else 'off'} prefix cache hit",
        st["prefix_cache_hit_tokens"] > 0,
        f"{st['prefix_cache_hit_tokens']} prompt tokens from the prefix cache",
    )


def sec_logits(c: Ctx) -> None:
    import torch

    rng = random.Random(3)
    if c.dry:
        shape, dtypes, lens, prefix, max_tokens = "tiny", [torch.float32], [3, 6, 13, 4], 8, 4
    else:
        shape, dtypes, lens, prefix, max_tokens = "smollm2-135m", [torch.float32, torch.bfloat16], [], 40, 24
        lens = [5, 33, 64, 130, 300, 520, 77, 9, 700, 250]
    loaded = build(shape, c.device, dtypes[0])
    vocab = loaded.hf_config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(n)] for i, n in enumerate(lens)]
    tol = {torch.float32: 2e-3, torch.bfloat16: 0.3}
    for dtype in dtypes:
        if loaded.model.dtype != dtype:
            loaded.model.to(dtype)
            loaded.dtype = dtype
        name = str(dtype)[6:]
        runs: dict[bool, list[Any]] = {}
        for graphs in (True, False):
            args = (loaded, graphs, prompts, max_tokens, name, runs)
            c.run(f"{name} engine graphs={'on' if graphs else 'off'}", _logits_run, c, *args)
        loaded.model.set_attn_implementation("sdpa")
        for graphs, outs in runs.items():
            worst_diff = worst_margin = 0.0
            top_overlap = []
            for p, o in zip(prompts, outs):
                hf = _hf_logprobs(loaded, p, o.token_ids)
                for j, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
                    worst_diff = max(worst_diff, abs(entry["logprob"] - hf[j, tok].item()))
                    worst_margin = max(worst_margin, (hf[j].max() - hf[j, tok]).item())
                    hf_top = set(hf[j].topk(5).indices.tolist())
                    top_overlap.append(len(hf_top & {t for t, _ in entry["top"]}) / 5)
            ntok = sum(len(o.token_ids) for o in outs)
            c.check(
                f"{name} graphs={'on' if graphs else 'off'} vs HF sdpa",
                worst_diff < tol[dtype] and worst_margin < tol[dtype],
                f"{len(prompts)} prompts, {ntok} tokens teacher-forced: max |logprob diff| {worst_diff:.2e}, "
                f"engine token below HF's top-1 by at most {worst_margin:.2e}, top-5 overlap "
                f"{100 * sum(top_overlap) / max(len(top_overlap), 1):.0f}% (tolerance {tol[dtype]:g})",
            )
        if len(runs) == 2:  # graphs against eager, over each pair's common prefix of tokens
            diff, same = 0.0, 0
            for a, b in zip(runs[True], runs[False]):
                for ta, tb, ea, eb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
                    if ta != tb:
                        break
                    same += 1
                    diff = max(diff, abs(ea["logprob"] - eb["logprob"]))
            ntok = sum(len(o.token_ids) for o in runs[True])
            c.check(
                f"{name} graphs on vs off",
                diff < tol[dtype],  # a near-tie may flip a token between batch shapes: only the logprobs gate
                f"{same} of {ntok} tokens identical before any divergence, max |logprob diff| {diff:.2e}",
            )


# ------------------------------------------------------------------------------------------------
# 4: throughput against HF static batching
# ------------------------------------------------------------------------------------------------


def workload(n: int, vocab: int, seed: int = 0, cap: int | None = None) -> tuple[list[list[int]], list[int]]:
    sys.path.insert(0, HERE)
    from workload import reference_requests

    rng = random.Random(seed)
    reqs = reference_requests(n, seed)
    # ~1.25 tokens per word plus the chat template, as SmolLM2's tokenizer gives on this workload
    prompts = [
        [rng.randrange(100, min(40000, vocab)) for _ in range(35 + int(1.25 * len(m[0]["content"].split())))]
        for m, _ in reqs
    ]
    if cap is not None:
        prompts = [p[:cap] for p in prompts]
    return prompts, [mt if cap is None else min(mt, 2) for _, mt in reqs]


class Timer:
    """Host time (perf_counter) and device time (CUDA events on the current stream) of one region."""

    def __init__(self, c: Ctx) -> None:
        self.c = c

    def __enter__(self) -> Timer:
        import torch

        self.c.sync()
        self.ev = None
        if self.c.device.type == "cuda":
            self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.ev[0].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ev is not None:
            self.ev[1].record()
        self.c.sync()
        self.host = time.perf_counter() - self.t0
        # None on the CPU: there is no device clock to read
        self.device = self.ev[0].elapsed_time(self.ev[1]) / 1e3 if self.ev is not None else None


def _s(seconds: float | None, scale: float = 1.0, unit: str = "s") -> str:
    return "n/a" if seconds is None else f"{seconds * scale:.2f} {unit}"


def _engine_run(eng: Any, prompts: list[list[int]], max_tokens: list[int], tag: str) -> None:
    from batchery.engine.sampling import SamplingParams

    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    _drain(eng)


def _hf_static(loaded: Any, prompts: list[list[int]], max_tokens: list[int], batch_size: int = 64) -> None:
    import torch

    model = loaded.model
    model.set_attn_implementation("sdpa")
    dev = loaded.device
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, mts = prompts[b : b + batch_size], max_tokens[b : b + batch_size]
            w = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (w - len(p)) + p for p in batch], device=dev)
            mask = torch.tensor([[0] * (w - len(p)) + [1] * len(p) for p in batch], device=dev)
            n = max(mts)
            model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
            )


def sec_throughput(c: Ctx) -> None:
    import torch

    n = min(c.args.requests, 4) if c.dry else c.args.requests
    loaded = build("tiny" if c.dry else "smollm2-135m", c.device, torch.bfloat16 if not c.dry else torch.float32)
    vocab = loaded.hf_config.vocab_size
    cap = 6 if c.dry else None  # the interpreter runs a program per stored token: keep the dry run short
    prompts, max_tokens = workload(n, vocab, 0, cap)
    warm_p, warm_m = workload(max(2, n // 8), vocab, 1, cap)  # a slice of the same shape, other prompts
    eng = _engine(c, loaded, True, max_num_seqs=512, max_num_batched_tokens=8192)
    _engine_run(eng, warm_p, warm_m, "warm")  # Triton compiles and graph buckets warm up here, untimed
    steps0, graph0 = eng.num_steps, eng.stats()["cuda_graph_steps"]
    with Timer(c) as t:
        _engine_run(eng, prompts, max_tokens, "")
    st = eng.stats()
    tokens = sum(max_tokens)
    eng_tps = tokens / t.host
    print(
        f"  engine     {eng_tps:10.1f} generated tok/s: host {t.host:.2f} s, device span {_s(t.device)} "
        f"({st['num_steps'] - steps0} steps, {st['cuda_graph_steps'] - graph0} from graphs, "
        f"mean batch {st['mean_batch_size']:.0f} seqs)",
        flush=True,
    )
    del eng
    gc.collect()
    _hf_static(loaded, warm_p[: min(len(warm_p), 64)], [4] * min(len(warm_p), 64))  # HF's warm-up
    with Timer(c) as th:
        _hf_static(loaded, prompts, max_tokens)
    hf_tps = tokens / th.host
    ratio = eng_tps / hf_tps
    print(f"  HF static  {hf_tps:10.1f} generated tok/s (batch 64): host {th.host:.2f} s, device span {_s(th.device)}")
    print(f"  ratio      {ratio:10.2f}x  (target >= 8x)")
    c.figures.update(
        {
            f"engine tok/s ({n} requests)": round(eng_tps, 1),
            "HF static tok/s (batch 64)": round(hf_tps, 1),
            "engine / HF static": f"{ratio:.2f}x (target >= 8x)",
        }
    )
    c.check("throughput ran", True, f"{n} requests, {tokens} generated tokens each way")
    if not c.dry and ratio < 8:
        c.miss = True


# ------------------------------------------------------------------------------------------------
# 5: the 1B decode step against the HBM bound
# ------------------------------------------------------------------------------------------------


def _decode_step(c: Ctx, loaded: Any, batch: int, context: int, steps: int, graphs: bool) -> dict[str, Any]:
    import torch

    from batchery.engine.sampling import SamplingParams

    bs = 8
    blocks = batch * -(-(context + steps + 64) // bs) + 16
    eng = _engine(
        c, loaded, graphs, max_num_seqs=batch, max_num_batched_tokens=16384, block_size=bs, num_kv_blocks=blocks
    )
    rng = random.Random(0)
    vocab = loaded.hf_config.vocab_size
    for i in range(batch):
        eng.add_request(
            str(i),
            [rng.randrange(100, vocab) for _ in range(context)],
            SamplingParams(temperature=0, max_tokens=steps + 50, ignore_eos=True),
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    for _ in range(1 if c.dry else 3):
        eng.step()  # warm: every kernel of the decode shape compiled, the graph bucket replayed
    with Timer(c) as t:
        for _ in range(steps):
            eng.step()
    out: dict[str, Any] = {"host_ms": t.host / steps * 1e3}
    out["device_span_ms"] = None if t.device is None else t.device / steps * 1e3
    g = eng.runner.graphs
    if graphs and c.device.type == "cuda" and g is not None and getattr(g, "graphs", None):
        entry = g.graphs.get(batch) or next(iter(g.graphs.values()))
        graph = entry[0] if isinstance(entry, tuple) else entry
        if hasattr(graph, "replay"):
            graph.replay()  # the last step's inputs again: same K/V into the same slots
            with Timer(c) as tr:
                for _ in range(steps):
                    graph.replay()
            out["replay_ms"] = (tr.device or 0.0) / steps * 1e3
        else:
            print("  (no graph to replay alone in this build: no replay-only figure)")
    out["graph_steps"] = float(eng.stats()["cuda_graph_steps"])
    del eng, g
    gc.collect()
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def sec_decode(c: Ctx) -> None:
    import torch

    if c.dry:
        loaded, batch, context, steps = build("tiny", c.device, torch.float32), 2, 8, 2
    else:
        loaded, batch, context, steps = build("llama-1b", c.device, torch.bfloat16), 256, 512, 20
    cfg = loaded.hf_config
    params = sum(p.numel() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    elem = loaded.model.dtype.itemsize
    ctx = context + 3 + steps // 2
    kv_bytes = 2 * cfg.num_hidden_layers * batch * ctx * cfg.num_key_value_heads * head_dim * elem
    bound_ms = (params * elem + kv_bytes) / HBM_BYTES_PER_S * 1e3
    res: dict[bool, dict[str, Any]] = {}
    for graphs in (True, False):

        def one(graphs: bool = graphs) -> None:
            r = res[graphs] = _decode_step(c, loaded, batch, context, steps, graphs)
            replay = f", graph replay alone {r['replay_ms']:.2f} ms" if "replay_ms" in r else ""
            print(
                f"  graphs {'on ' if graphs else 'off'}: decode step {r['host_ms']:8.2f} ms host, "
                f"{_s(r['device_span_ms'], unit='ms')} device span{replay}; HBM bound {bound_ms:.2f} ms (4.3 TB/s): "
                f"{r['host_ms'] / bound_ms:.2f}x",
                flush=True,
            )

        c.run(f"decode graphs={'on' if graphs else 'off'}", one)
    if True in res:
        r = res[True]
        c.check("decode graphs used", r["graph_steps"] > 0, f"{r['graph_steps']:.0f} steps through the decode graphs")
        c.figures["1B decode step, graphs on (ms)"] = round(r["host_ms"], 3)
        if r["device_span_ms"] is not None:
            c.figures["1B decode step device span (ms)"] = round(r["device_span_ms"], 3)
        if "replay_ms" in r:
            c.figures["1B graph replay alone (ms)"] = round(r["replay_ms"], 3)
        c.figures["HBM bound (ms)"] = round(bound_ms, 3)
        c.figures["decode / HBM bound"] = f"{r['host_ms'] / bound_ms:.2f}x (target <= 2x)"
        if not c.dry and r["host_ms"] / bound_ms > 2:
            c.miss = True
    if False in res:
        c.figures["1B decode step, graphs off (ms)"] = round(res[False]["host_ms"], 3)
        c.figures["decode graphs off / HBM bound"] = f"{res[False]['host_ms'] / bound_ms:.2f}x"
        if True in res:
            c.figures["graphs speed-up"] = f"{res[False]['host_ms'] / res[True]['host_ms']:.2f}x"


SECTION_FNS: dict[str, Callable[[Ctx], None]] = {
    "kernels": sec_kernels,
    "bigpool": sec_bigpool,
    "logits": sec_logits,
    "throughput": sec_throughput,
    "decode": sec_decode,
}


def child(args: argparse.Namespace) -> int:
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")
    logging.getLogger("batchery.engine.graphs").setLevel(logging.INFO)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("gpu_check --dry-run: TRITON_INTERPRET=1 must be set before triton is imported")
        _patch_interpreter()
    elif not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    c = Ctx(args)
    if args.section == "kernels":  # the first section names the machine
        from importlib.metadata import version

        dev = torch.cuda.get_device_name(0) if not c.dry else "CPU (Triton interpreter)"
        print(f"  {dev}, torch {torch.__version__}, transformers {version('transformers')}, triton {version('triton')}")
    if args.inject_crash == args.section:
        print("  (crash injected: this section's process aborts, as a CUDA fault would end it)", flush=True)
        os.abort()
    if args.inject_slot_bug:
        _inject_slot_bug()
    try:
        SECTION_FNS[args.section](c)
    except Exception:
        c.check("section", False, "raised " + traceback.format_exc().strip().replace("\n", "\n      "))
    if not c.checks:
        c.check("section", False, "ran no check")
    ok = all(good for _, good in c.checks)
    status = "FAIL" if not ok else "MISS" if c.miss else "PASS"
    detail = "a figure missed its target" if status == "MISS" else ""
    print(RESULT_TAG + json.dumps({"status": status, "checks": c.checks, "figures": c.figures, "detail": detail}))
    sys.stdout.flush()
    return 0 if status == "PASS" else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512, help="requests of the throughput section")
    ap.add_argument("--dry-run", action="store_true", help="every section's code path on the CPU, tiny sizes")
    ap.add_argument("--inject-slot-bug", action="store_true", help="swap each stored slot with its neighbour")
    ap.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all sections together")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # the child's own section
    # the named section's process aborts at start: shows that one crash fails only its own section
    ap.add_argument("--inject-crash", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section is not None:
        sys.exit(child(args))
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
