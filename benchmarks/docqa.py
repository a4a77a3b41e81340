"""Document questions: the whole product (``batchery run``) against ``vllm run-batch`` on one
OpenAI batch file whose lines share long prefixes.

    python benchmarks/docqa.py [--docs 96] [--questions 3] [--lines N] [--workers 2] [--skip-vllm]

The file: ``--docs`` documents of ``--words`` (500) or more words each, prose from a fixed
vocabulary (deterministic with ``--seed``), each the system message of ``--questions`` lines whose
user message asks about it; the lines shuffled; every answer exactly ``--max-tokens`` tokens
(``max_tokens`` with ``ignore_eos: true``, a field Batchery's contract and vLLM's both accept),
greedy. ``--lines`` keeps only the first N lines of the shuffled file. The file is checked with
Batchery's own batch parser before anything runs.

Runs, one after another:

- ``batchery run FILE -o OUT --errors ERR --json``: the embedded stack (a private Redis and one
  worker), start-up included. Wall is measured around the command; the work part is its summary's
  ``running_s`` (from the first line a worker started, i.e. after the model loaded, to the job's end).
- with ``--workers N`` (N > 1): one private Redis and N ``batchery worker`` processes on one queue,
  the file submitted with the Python client once every worker is ready; the work part is again the
  job's ``running_s``. Which worker served each line is read from the workers' JSON logs (Celery's
  ``succeeded`` line carries the line's custom_id), so the hit rate is printed per worker too.
- ``python -m vllm.entrypoints.openai.run_batch`` from the peer venv (``benchmarks/vllm_env.sh``)
  with ``--gpu-memory-utilization 0.5`` (a 24 GiB machine refuses its default), the served model
  name equal to the file's ``model``, ``--enable-prompt-tokens-details`` and the same dtype. Its work
  part is the time between its ``Reading batch from`` log line and its ``Writing outputs to`` line,
  each stamped here as it arrives (its own log timestamps have whole seconds only).

For each: wall seconds, the work part, the prefix-cache hit rate (cached / prompt tokens, summed
over the output lines' ``usage``) and the prompt tokens actually computed (prompt minus cached),
against the minimum: every distinct prefix of the tokenized prompts once, plus each line's own
tail, by exact longest-common-prefix matching (``vllm_peer.min_prompt_tokens``; the block-granular
minimum at Batchery's block size is printed beside it). The prompts are tokenized with the model's
tokenizer and chat template as Batchery renders them; each side's own ``prompt_tokens`` are shown too.
Every output line must parse and every line of the file must be answered, with the requested length.
Run it on a quiet machine (vLLM-CPU binds and spins its OpenMP threads on the cores); ``--keep DIR``
keeps the file, outputs and logs, ``--json PATH`` the figures."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_peer import (  # noqa: E402
    batchery_bin,
    cpu_line,
    hf_dir,
    min_prompt_tokens,
    require_vllm_python,
    vllm_env,
    write_json,
)
from workload import VOCAB  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
CHAT_URL = "/v1/chat/completions"
BLOCK_SIZE = 8  # Batchery's default KV block size (EngineConfig.block_size), for the block-granular minimum

_ADJ = "old new small large quiet bright dark early late long short warm cold green grey narrow wide".split()
_VERBS = (
    "follows crosses carries holds opens closes remembers changes keeps finds leaves reaches shapes watches "
    "joins feeds measures guards turns builds"
).split()
_PREPS = "near beyond under above across behind beside through after before".split()
_LINKS = ["Meanwhile", "Later", "In the end", "At first", "For a while", "Even so", "Often", "Each year"]
_QUESTIONS = [
    "What does the document say about the {a}?",
    "How are the {a} and the {b} connected in the text?",
    "Summarize what happens to the {a} in two sentences.",
    "Which place near the {a} does the document describe?",
    "What changes for the {b} by the end of the document?",
]


# -- the workload --------------------------------------------------------------------------------
def _sentence(rng: random.Random) -> str:
    words = [
        rng.choice(["The", "A", "Every", "One"]),
        rng.choice(_ADJ),
        rng.choice(VOCAB),
        rng.choice(_VERBS),
        "the",
        rng.choice(VOCAB),
        rng.choice(_PREPS),
        "the",
        rng.choice(_ADJ),
        rng.choice(VOCAB),
    ]
    if rng.random() < 0.4:
        words = [rng.choice(_LINKS) + ","] + [words[0].lower()] + words[1:]
    if rng.random() < 0.5:
        words += ["and", rng.choice(_VERBS), "the", rng.choice(VOCAB)]
    return " ".join(words) + "."


def make_document(rng: random.Random, index: int, min_words: int) -> str:
    """One document of at least ``min_words`` words: a title, then paragraphs of sentences."""
    title = f"Report {index + 1}: the {rng.choice(VOCAB)} and the {rng.choice(VOCAB)}"
    paragraphs, n = [], 0
    while n < min_words:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(4, 7)))
        paragraphs.append(para)
        n += len(para.split())
    return title + "\n\n" + "\n\n".join(paragraphs)


def make_lines(
    num_docs: int = 96,
    questions: int = 3,
    *,
    min_words: int = 500,
    max_tokens: int = 32,
    model: str = DEFAULT_MODEL,
    seed: int = 0,
    num_lines: int | None = None,
) -> list[dict]:
    """The OpenAI batch lines, shuffled (deterministic in every argument)."""
    rng = random.Random(seed)
    lines = []
    for d in range(num_docs):
        doc = make_document(rng, d, min_words)
        nouns = [w for w in doc.split() if w in VOCAB]
        for q in range(questions):
            a, b = rng.choice(nouns), rng.choice(nouns)
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": doc},
                    {"role": "user", "content": _QUESTIONS[(d + q) % len(_QUESTIONS)].format(a=a, b=b)},
                ],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            lines.append({"custom_id": f"doc{d:03d}-q{q}", "method": "POST", "url": CHAT_URL, "body": body})
    rng.shuffle(lines)
    return lines[:num_lines] if num_lines is not None else lines


def write_jsonl(path: Path, lines: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def validate_file(path: Path) -> int:
    """Every line of ``path`` through Batchery's batch parser; returns how many, raises on a bad one."""
    from batchery.contract.batch import LineError, parse_stream

    n = 0
    with open(path, "rb") as f:
        for item in parse_stream(f, max_line_bytes=1 << 22):
            if isinstance(item, LineError):
                raise ValueError(f"{path}:{item.line}: {item.code}: {item.message}")
            n += 1
    return n


def tokenized_prompts(lines: list[dict], model_dir: Path) -> list[list[int]]:
    """Each line's prompt token ids, through the model's chat template as Batchery renders it."""
    from transformers import AutoTokenizer

    from batchery.engine.chat_template import render_chat

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    return [render_chat(tok, line["body"]["messages"]) for line in lines]


# -- outputs -------------------------------------------------------------------------------------
def read_outputs(path: Path, lines: list[dict], max_tokens: int) -> dict[str, dict]:
    """The output records by custom_id; raises unless every line parses, every line of the input has
    a 200 answer, and every answer has ``max_tokens`` completion tokens."""
    want = {line["custom_id"] for line in lines}
    got: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            rec = json.loads(raw)
            resp = rec.get("response") or {}
            if rec.get("error") or resp.get("status_code") != 200:
                raise ValueError(f"{path}:{i}: not answered: {json.dumps(rec)[:300]}")
            usage = resp["body"]["usage"]
            if usage["completion_tokens"] != max_tokens:
                raise ValueError(f"{path}:{i}: {usage['completion_tokens']} completion tokens, not {max_tokens}")
            got[rec["custom_id"]] = rec
    missing = want - got.keys()
    if missing:
        raise ValueError(f"{path}: {len(missing)} of {len(want)} lines not answered, e.g. {sorted(missing)[:3]}")
    return got


def prompt_usage(records: list[dict]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) summed over output records."""
    prompt = cached = 0
    for rec in records:
        usage = rec["response"]["body"]["usage"]
        prompt += usage["prompt_tokens"]
        cached += ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return prompt, cached


def lines_by_worker(logs: list[Path], records: dict[str, dict] | None = None) -> dict[str, int]:
    """custom_id -> the index of the worker that ran that line: from the records' ``timing.worker`` (an opaque
    per-process id, numbered in order of first appearance), else from the workers' JSON logs."""
    owner: dict[str, int] = {}
    ids: dict[str, int] = {}
    for cid, rec in sorted((records or {}).items()):
        wid = (((rec.get("response") or {}).get("body") or {}).get("timing") or {}).get("worker")
        if wid:
            owner[cid] = ids.setdefault(wid, len(ids))
    if owner:
        return owner
    for w, log in enumerate(logs):
        for raw in log.read_text(errors="replace").splitlines():
            if not raw.startswith("{"):
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if rec.get("custom_id") and "succeeded" in str(rec.get("message", "")):
                owner[rec["custom_id"]] = w
    return owner


# -- the runs ------------------------------------------------------------------------------------
def _stamped(proc: subprocess.Popen, log: Path, marks: dict[str, str]) -> dict[str, float]:
    """Copy ``proc``'s output to ``log``; the monotonic time each ``marks`` substring first appeared."""
    seen: dict[str, float] = {}
    with open(log, "w", encoding="utf-8") as out:
        for raw in proc.stdout:
            now = time.monotonic()
            line = raw.decode("utf-8", errors="replace")
            out.write(line)
            for name, needle in marks.items():
                if name not in seen and needle in line:
                    seen[name] = now
    proc.wait()
    return seen


def run_batchery(file: Path, workdir: Path, env: dict[str, str]) -> dict:
    """``batchery run`` (embedded, one worker): wall around the command and its JSON summary."""
    out, err = workdir / "batchery-out.jsonl", workdir / "batchery-errors.jsonl"
    cmd = [batchery_bin("batchery"), "run", str(file), "-o", str(out), "--errors", str(err), "--json", "--no-progress"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (workdir / "batchery-run.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"batchery run exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "work_s": s["running_s"], "output": out, "summary": s}


def run_batchery_workers(file: Path, workdir: Path, env: dict[str, str], num_workers: int) -> dict:
    """A private Redis and ``num_workers`` ``batchery worker`` processes on one queue; the file
    submitted once all are ready. Wall from the start of Redis to the results written."""
    from batchery.client import Client
    from batchery.contract.settings import Settings
    from batchery.embedded import WORKER_READY_LINE, EmbeddedStack
    from batchery.run import summary, write_results

    # the workers share this machine's cores: each gets its share of threads (N workers of all the cores' threads
    # each oversubscribe the CPU; measured here, 2 workers x 2 threads on 2 cores took 7x one worker's time)
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    env = {"OMP_NUM_THREADS": str(threads)} | env
    print(f"  {num_workers} workers, {env['OMP_NUM_THREADS']} torch threads each (OMP_NUM_THREADS)")
    t0 = time.monotonic()
    # the embedded stack gives a private Redis (free port, password, no persistence) and the first worker
    stack = EmbeddedStack(workdir / "w0", env=env)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    others: list[subprocess.Popen] = []
    logs = [stack.worker_log]
    try:
        url = stack.start()
        for i in range(1, num_workers):
            log = workdir / f"worker{i}.log"
            wenv = env | {
                "BATCHERY_BROKER_URL": url,
                "BATCHERY_RESULT_BACKEND": url,
                "BATCHERY_HEALTH_PORT": "0",
                "PYTHONUNBUFFERED": "1",
            }
            wenv.pop("BATCHERY_QUEUE", None)
            with open(log, "wb") as f:
                others.append(
                    subprocess.Popen([batchery_bin("batchery"), "worker"], env=wenv, stdout=f, stderr=subprocess.STDOUT)
                )
            logs.append(log)
        while not all(p.exists() and WORKER_READY_LINE in p.read_text(errors="replace") for p in logs):
            stack.check()
            for p in others:
                if p.poll() is not None:
                    raise RuntimeError(f"a worker exited with {p.returncode}; see {workdir}")
            time.sleep(0.2)
        ready = time.monotonic() - t0
        out, err = workdir / f"batchery-{num_workers}w-out.jsonl", workdir / f"batchery-{num_workers}w-errors.jsonl"
        with Client(settings=Settings(broker_url=url, result_backend=url, queue=None)) as c:
            job_id = c.submit_batch(str(file))
            job = c.wait_batch(job_id)
            num_ok, num_err = write_results(c.batch_results(job_id), out, err)
        wall = time.monotonic() - t0
        s = summary(job, wall, num_ok, num_err)
    finally:
        for p in others:
            p.terminate()
        for p in others:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        stack.stop()
    return {"wall_s": wall, "ready_s": ready, "work_s": s["running_s"], "output": out, "summary": s, "logs": logs}


def run_vllm_batch(file: Path, workdir: Path, model_dir: Path, served: str, dtype: str, extra: list[str]) -> dict:
    """``vllm run-batch`` from the peer venv: wall around the process, and the work part between
    its 'Reading batch from' and 'Writing outputs to' log lines."""
    py = require_vllm_python()
    out = workdir / "vllm-out.jsonl"
    cmd = [
        str(py), "-m", "vllm.entrypoints.openai.run_batch",
        "-i", str(file), "-o", str(out),
        "--model", str(model_dir), "--served-model-name", served, "--dtype", dtype,
        "--gpu-memory-utilization", "0.5", "--enable-prompt-tokens-details",
        *extra,
    ]  # fmt: skip
    env = vllm_env(threads=os.cpu_count() or 1, kv_gib=None) | {"PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir)
    log = workdir / "vllm-run-batch.log"
    marks = _stamped(proc, log, {"start": "Reading batch from", "end": "Writing outputs to"})
    wall = time.monotonic() - t0
    if proc.returncode != 0 or "start" not in marks or "end" not in marks:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vllm run-batch exited {proc.returncode} (log {log}):\n{tail}")
    return {"wall_s": wall, "work_s": marks["end"] - marks["start"], "startup_s": marks["start"] - t0, "output": out}


# -- report --------------------------------------------------------------------------------------
def report(name: str, run: dict, records: dict[str, dict], minimum: int) -> dict:
    prompt, cached = prompt_usage(list(records.values()))
    computed = prompt - cached
    print(
        f"  {name:<22} wall {run['wall_s']:7.1f} s   work {run['work_s']:7.1f} s   "
        f"hit rate {100 * cached / prompt:5.1f}%"
        f"   prompt {prompt} tokens, computed {computed} ({computed / minimum:.2f}x the minimum)"
    )
    figures = {k: run[k] for k in ("wall_s", "work_s", "startup_s", "ready_s") if k in run}
    return figures | {
        "lines": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt,
        "computed": computed,
        "computed_over_minimum": computed / minimum,
    }


def per_worker(records: dict[str, dict], owner: dict[str, int], num_workers: int) -> dict:
    """{"workers": one dict per worker, "documents_split": documents whose questions ran on more than one
    worker, "documents": how many documents}"""
    out: list[dict] = []
    for w in range(num_workers):
        mine = [r for cid, r in records.items() if owner.get(cid) == w]
        if not mine:
            print(f"    worker {w}: no lines")
            out.append({"lines": 0})
            continue
        prompt, cached = prompt_usage(mine)
        print(f"    worker {w}: {len(mine)} lines, hit rate {100 * cached / prompt:5.1f}%, computed {prompt - cached}")
        out.append({"lines": len(mine), "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt})
    unknown = len(records) - sum(1 for cid in records if cid in owner)
    if unknown:
        print(f"    ({unknown} lines whose worker is unknown)")
    # affinity: over how many workers each document's questions were spread (1 = all on one worker)
    spread: dict[str, set[int]] = {}
    for cid in records:
        if cid in owner:
            spread.setdefault(cid.split("-q")[0], set()).add(owner[cid])
    split = sum(1 for ws in spread.values() if len(ws) > 1)
    if spread:
        print(f"    documents whose questions ran on more than one worker: {split} of {len(spread)}")
    return {"workers": out, "documents_split": split, "documents": len(spread)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=96)
    ap.add_argument("--questions", type=int, default=3, help="questions (lines) per document")
    ap.add_argument("--words", type=int, default=500, help="at least this many words per document")
    ap.add_argument("--lines", type=int, default=None, help="keep only the first N lines of the shuffled file")
    ap.add_argument("--max-tokens", type=int, default=32, help="every answer's exact length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", help="both sides' dtype; auto: bfloat16 where the CPU has it")
    ap.add_argument("--workers", type=int, default=1, help="also run N workers on one queue (N > 1)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vllm run-batch")
    ap.add_argument("--keep", metavar="DIR", help="keep the file, outputs and logs in DIR")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args()

    import torch

    from batchery.engine.loader import resolve_dtype

    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="docqa-"))
    workdir.mkdir(parents=True, exist_ok=True)
    lines = make_lines(
        args.docs,
        args.questions,
        min_words=args.words,
        max_tokens=args.max_tokens,
        model=args.model,
        seed=args.seed,
        num_lines=args.lines,
    )
    file = workdir / "docqa.jsonl"
    write_jsonl(file, lines)
    n = validate_file(file)
    model_dir = hf_dir(args.model)
    prompts = tokenized_prompts(lines, model_dir)
    exact, blocked = min_prompt_tokens(prompts), min_prompt_tokens(prompts, BLOCK_SIZE)
    docs = {line["body"]["messages"][0]["content"] for line in lines}
    print(f"torch threads {torch.get_num_threads()}, dtype {dtype}, cpu {torch.backends.cpu.get_cpu_capability()}")
    print(f"cpu: {cpu_line()}")
    print(
        f"{file}: {n} lines, {len(docs)} documents (min {min(len(d.split()) for d in docs)} words), "
        f"{args.max_tokens} tokens per answer; {sum(map(len, prompts))} prompt tokens, minimum computed {exact} "
        f"(exact prefix; {blocked} in blocks of {BLOCK_SIZE})"
    )
    env = dict(os.environ) | {"BATCHERY_DTYPE": dtype, "BATCHERY_MODEL": args.model, "BATCHERY_LOG_FORMAT": "json"}
    env.pop("BATCHERY_BROKER_URL", None)  # embedded, always
    env.pop("BATCHERY_RESULT_BACKEND", None)

    results = []
    b = run_batchery(file, workdir, env)
    results.append(("batchery run (1 worker)", b, read_outputs(b["output"], lines, args.max_tokens)))
    multi = None
    if args.workers > 1:
        multi = run_batchery_workers(file, workdir, env, args.workers)
        results.append(
            (f"batchery ({args.workers} workers)", multi, read_outputs(multi["output"], lines, args.max_tokens))
        )
    if not args.skip_vllm:
        v = run_vllm_batch(file, workdir, model_dir, args.model, dtype, args.vllm_arg)
        results.append(("vllm run-batch", v, read_outputs(v["output"], lines, args.max_tokens)))

    figures: dict = {
        "cpu": cpu_line(),
        "dtype": dtype,
        "lines": n,
        "documents": len(docs),
        "max_tokens": args.max_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "minimum_exact": exact,
        f"minimum_blocks_{BLOCK_SIZE}": blocked,
        "runs": {},
    }
    print(f"\nresults ({workdir}):")
    for name, run, records in results:
        figures["runs"][name] = report(name, run, records, exact)
        side_prompt = prompt_usage(list(records.values()))[0]
        extra = f", start-up {run['startup_s']:.1f} s" if "startup_s" in run else ""
        if "ready_s" in run:
            extra = f", workers ready after {run['ready_s']:.1f} s"
        print(f"    {len(records)} of {n} lines answered, {side_prompt} prompt tokens by its own count{extra}")
        if run is multi:
            figures["runs"][name]["per_worker"] = per_worker(
                records, lines_by_worker(multi["logs"], records), args.workers
            )
    if not args.skip_vllm:
        bw, vw = results[0][1], results[-1][1]
        print(
            f"\nbatchery run / vllm run-batch: {vw['wall_s'] / bw['wall_s']:.2f}x faster on wall (start-up included), "
            f"{vw['work_s'] / bw['work_s']:.2f}x on the work part"
        )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
