"""Embedding throughput: Batchery's engine (``LLM.embed``) against sentence-transformers' ``encode``, same run, same
machine, same threads (issue 38).

The workload: N inputs (10,000 by default) of 10-200 words each, uniformly mixed, shuffled, drawn from a fixed
vocabulary with a fixed seed. The model is the built-in all-MiniLM-L6-v2 (both sides load the same directory).
sentence-transformers runs at its default batch size (32) and at each of ``--st-batch-sizes``; the best of those is
reported too. Batchery runs in fp32 (the reference's dtype) and in its default dtype ("auto": bf16 on CPUs with
AVX512-BF16 or AMX, else fp32). Each side embeds a warm-up slice first; the timed pass is the whole list. The two
sides' vectors are compared (minimum cosine) so a fast wrong answer cannot pass.

    .venv/bin/python benchmarks/embeddings.py                    # 10,000 inputs, the full comparison
    .venv/bin/python benchmarks/embeddings.py --num-inputs 1000  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch

WORDS = (
    "the of and to in is was for on are with as by at from that this be or an it not which have has had were "
    "data model search query document retrieval vector index corpus chunk embedding passage answer question "
    "river mountain city light music book paper stone fire wind rain snow tree flower apple market price "
    "science history language network system process result method analysis report policy energy water health"
).split()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def workload(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 200))) for _ in range(n)]
    rng.shuffle(texts)
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=10_000)
    ap.add_argument("--st-batch-sizes", default="16,32,64,128", help="sentence-transformers batch sizes to try")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="Batchery's token budget per step")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from batchery.contract.names import EMBEDDING_MODEL
    from batchery.engine.llm import LLM
    from batchery.engine.loader import hf_model_dir

    texts = workload(args.num_inputs)
    warm = texts[:64]
    model_dir = str(hf_model_dir(EMBEDDING_MODEL))
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs, torch threads {threads}, torch {torch.__version__}")
    print(f"workload: {len(texts)} inputs of 10-200 words, shuffled; model {EMBEDDING_MODEL} ({model_dir})")
    figures: dict[str, float] = {}

    st = SentenceTransformer(model_dir, device="cpu")
    ref = None
    sizes = sorted({32, *(int(b) for b in args.st_batch_sizes.split(",") if b)})
    for bs in sizes:
        st.encode(warm, batch_size=bs)
        t0 = time.perf_counter()
        out = st.encode(texts, batch_size=bs, convert_to_tensor=True)
        dt = time.perf_counter() - t0
        figures[f"st_bs{bs}"] = len(texts) / dt
        if bs == 32:
            ref = out.float()
        print(
            f"sentence-transformers encode, batch_size {bs}{' (default)' if bs == 32 else ''}: "
            f"{dt:.2f} s, {len(texts) / dt:.1f} inputs/s"
        )
    best_bs = max(sizes, key=lambda b: figures[f"st_bs{b}"])
    del st

    kwargs = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    for dtype in ("float32", "auto"):
        llm = LLM(EMBEDDING_MODEL, dtype=dtype, device="cpu", **kwargs)
        llm.embed(warm)
        t0 = time.perf_counter()
        outs = llm.embed(texts)
        dt = time.perf_counter() - t0
        name = f"batchery_{dtype}"
        figures[name] = len(texts) / dt
        ours = torch.tensor([o.embedding for o in outs])
        cos = torch.nn.functional.cosine_similarity(ours, ref).min().item() if ref is not None else float("nan")
        figures[f"{name}_min_cosine"] = cos
        resolved = str(llm.engine.loaded.dtype).removeprefix("torch.")
        print(
            f"Batchery LLM.embed, {dtype} ({resolved}): {dt:.2f} s, {len(texts) / dt:.1f} inputs/s, "
            f"{llm.engine.num_steps} steps, min cosine vs sentence-transformers {cos:.6f}"
        )
        del llm

    for dtype in ("float32", "auto"):
        ours = figures[f"batchery_{dtype}"]
        print(
            f"ratio Batchery {dtype} / sentence-transformers default (32): {ours / figures['st_bs32']:.2f}x; "
            f"/ its best (batch_size {best_bs}): {ours / figures[f'st_bs{best_bs}']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": threads, "num_inputs": len(texts), **figures}, f, indent=1)


if __name__ == "__main__":
    main()
