"""Structured outputs on the real model: validity, and the cost of the grammar mask, in one run.

    python benchmarks/structured.py [--dtype float32] [--max-tokens 256] [--via-run]

1. The 50 lines of ``structured_workload.py`` (5 strict JSON schemas, 10 lines each), greedy,
   through the offline engine with ``structured_outputs={"json": schema}``: how many finish with
   ``stop``, and whether every such output parses and validates against its schema (the
   ``jsonschema`` package).
2. The same 50 prompts unconstrained, each forced to generate exactly as many tokens as its
   constrained run did (``ignore_eos``), so both runs do the same model work and differ only by the
   grammar: wall times, generated tokens/s and their ratio (constrained speed / unconstrained).
   The two runs alternate ``--repeats`` times; the best of each is reported.
3. With ``--via-run``: the same file through ``batchery run`` (the embedded stack, as a user runs
   it), its output file validated the same way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_workload import SCHEMAS, structured_lines, write_jsonl  # noqa: E402


def check(outputs: list[tuple[str, str, str]]) -> dict:
    """(schema name, finish_reason, text) per line -> counts of stop / valid / invalid."""
    import jsonschema

    stop = valid = 0
    bad: list[str] = []
    for name, finish, text in outputs:
        if finish != "stop":
            continue
        stop += 1
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append(f"{name}: {str(exc)[:120]}: {text[:120]!r}")
    return {"lines": len(outputs), "stop": stop, "valid": valid, "invalid": bad}


def engine_run(args) -> None:
    from batchery.engine.llm import LLM
    from batchery.engine.sampling import SamplingParams

    lines = structured_lines(args.max_tokens)
    llm = LLM(dtype=args.dtype)
    convs = [ln["body"]["messages"] for ln in lines]
    names = [ln["custom_id"].split("-")[0] for ln in lines]
    llm.chat(convs[:2], SamplingParams(max_tokens=8, temperature=0))  # warm-up

    def constrained():
        params = [
            SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs={"json": SCHEMAS[n]})
            for n in names
        ]
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        return time.perf_counter() - t0, outs

    def unconstrained(lengths: list[int]):
        params = [SamplingParams(max_tokens=max(1, k), temperature=0, ignore_eos=True) for k in lengths]
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        return time.perf_counter() - t0, outs

    best_c = best_u = float("inf")
    outs = None
    for _ in range(args.repeats):
        wc, outs = constrained()
        lengths = [len(o.token_ids) for o in outs]
        wu, uouts = unconstrained(lengths)
        assert [len(o.token_ids) for o in uouts] == [max(1, k) for k in lengths]
        best_c, best_u = min(best_c, wc), min(best_u, wu)
    assert outs is not None
    tokens = sum(len(o.token_ids) for o in outs)
    result = check([(n, o.finish_reason or "", o.text) for n, o in zip(names, outs, strict=True)])
    stats = llm.engine.stats()
    print(f"structured outputs, engine, {args.dtype}, {len(lines)} lines over {len(SCHEMAS)} schemas, greedy")
    print(
        f"  finished with stop: {result['stop']}/{result['lines']} ({100 * result['stop'] / result['lines']:.0f}%), "
        f"valid among them: {result['valid']}/{result['stop']}"
    )
    for b in result["invalid"]:
        print("  INVALID", b)
    compiled, hits = stats.get("grammar_compiled", "?"), stats.get("grammar_cache_hits", "?")
    print(f"  grammars compiled: {compiled}, cache hits: {hits}")
    print(
        f"  constrained:   {best_c:.2f} s, {tokens / best_c:.1f} generated tok/s\n"
        f"  unconstrained: {best_u:.2f} s, {tokens / best_u:.1f} generated tok/s (same token counts, ignore_eos)\n"
        f"  ratio (constrained speed / unconstrained): {best_u / best_c:.3f}  (best of {args.repeats} each)"
    )


def via_run(args) -> None:
    lines = structured_lines(args.max_tokens)
    names = {ln["custom_id"]: ln["custom_id"].split("-")[0] for ln in lines}
    with tempfile.TemporaryDirectory() as d:
        src, out, err = (os.path.join(d, n) for n in ("structured.jsonl", "out.jsonl", "err.jsonl"))
        write_jsonl(src, lines)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "batchery", "run", src, "-o", out, "--errors", err]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        print(proc.stdout[-1500:])
        if proc.returncode not in (0, 1):
            print(proc.stderr[-3000:])
            raise SystemExit(f"batchery run exited {proc.returncode}")
        records = [json.loads(x) for x in open(out)] if os.path.exists(out) else []
        errors = [json.loads(x) for x in open(err)] if os.path.exists(err) else []
    outputs = []
    for r in records:
        choice = r["response"]["body"]["choices"][0]
        outputs.append((names[r["custom_id"]], choice["finish_reason"], choice["message"]["content"] or ""))
    result = check(outputs)
    print(f"structured outputs via `batchery run`: wall {wall:.1f} s, {len(records)} results, {len(errors)} errors")
    print(f"  finished with stop: {result['stop']}/{len(lines)}, valid among them: {result['valid']}/{result['stop']}")
    for b in result["invalid"]:
        print("  INVALID", b)
    for e in errors[:5]:
        print("  ERROR", e.get("custom_id"), e.get("error"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--via-run", action="store_true", help="also run the file through `batchery run`")
    args = ap.parse_args()
    engine_run(args)
    if args.via_run:
        via_run(args)


if __name__ == "__main__":
    main()
