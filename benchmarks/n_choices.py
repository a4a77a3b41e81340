"""``n > 1`` against separate requests, in one run: the prompt computed once, and what it saves.

    python benchmarks/n_choices.py [--dtype float32] [--prompt-tokens 1000] [--n 4] [--max-tokens 16]

One prompt of about ``--prompt-tokens`` tokens, sampled at temperature 1 with a seed:
- ``n``: one request with ``SamplingParams(n=N)``;
- separate: N requests of the same prompt, added together (as a client sending N requests would;
  they are admitted in the same step, so the prefix cache cannot help them).
Both generate exactly ``--max-tokens`` tokens per choice (``ignore_eos``). Prints the wall times,
their ratio, and the engine's ``num_prompt_tokens_computed`` for each (prompt tokens actually run
through the model). Each side runs ``--repeats`` times, alternating, on a cold prefix cache; the
best is reported. Both with the prefix cache on (the default: separate requests admitted a chunk
apart then share part of the prompt through it) and off (each separate request computes it all)."""

from __future__ import annotations

import argparse
import time

DOC = (
    "The river rose slowly through the night, and by morning the lower streets of the town were under water. "
    "Shopkeepers carried their goods upstairs while the ferryman counted the boats tied along the old quay. "
)


def cold(engine) -> None:
    bm = engine.block_manager
    bm.hash_to_block.clear()
    bm.block_hash = [None] * bm.num_blocks


def run(engine, prompt: list[int], params, count: int) -> tuple[float, int, int]:
    cold(engine)
    before = engine.stats()["num_prompt_tokens_computed"]
    t0 = time.perf_counter()
    for i in range(count):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    choices = 0
    while engine.has_unfinished():
        for out in engine.step():
            choices += len(out.outputs)
    wall = time.perf_counter() - t0
    return wall, engine.stats()["num_prompt_tokens_computed"] - before, choices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from batchery.engine.config import EngineConfig
    from batchery.engine.llm import LLM
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.sampling import SamplingParams

    llm = LLM(dtype=args.dtype)
    text = DOC * (args.prompt_tokens // 30 + 2)
    prompt = llm.engine.encode(text)[: args.prompt_tokens]
    common = dict(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    print(
        f"n={args.n} on a {len(prompt)}-token prompt, {args.max_tokens} tokens per choice, {args.dtype}, "
        f"block size {llm.engine.config.block_size}, best of {args.repeats} each"
    )
    for caching in (True, False):
        cfg = EngineConfig(dtype=args.dtype, enable_prefix_caching=caching)
        engine = LLMEngine(cfg, loaded=llm.engine.loaded)
        engine.add_request("warm", prompt[:64], SamplingParams(max_tokens=4))  # warm-up
        while engine.has_unfinished():
            engine.step()
        best_n = best_sep = float("inf")
        comp_n = comp_sep = 0
        for _ in range(args.repeats):
            w, comp_n, k = run(engine, prompt, SamplingParams(n=args.n, seed=7, **common), 1)
            assert k == args.n, k
            best_n = min(best_n, w)
            w, comp_sep, k = run(engine, prompt, SamplingParams(seed=7, **common), args.n)
            assert k == args.n, k
            best_sep = min(best_sep, w)
        print(f"  prefix caching {'on (the default)' if caching else 'off'}:")
        print(f"    one request, n={args.n}:   {best_n:.2f} s, prompt tokens computed {comp_n}")
        print(f"    {args.n} separate requests: {best_sep:.2f} s, prompt tokens computed {comp_sep}")
        print(f"    speed-up: {best_sep / best_n:.2f}x")
        del engine


if __name__ == "__main__":
    main()
