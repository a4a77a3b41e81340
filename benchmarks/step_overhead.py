"""Host-side cost of one engine step with many sequences: what the CPU spends around the model.

    python benchmarks/step_overhead.py [--seqs 512] [--context 200]

Runs decode steps of ``--seqs`` sequences on a one-layer random-weight model (SmolLM2's vocabulary,
tiny hidden size), so the model's forward is cheap and the scheduler, batch packing, input tensors,
block bookkeeping and output handling show. On a GPU these run while the device would otherwise
wait, so at large batches they bound the step rate. Prints milliseconds per step for each part;
"forward" and "sampler" here are CPU figures for the tiny model and say little about a GPU.

Then the sampler alone, ``--sampler-rows`` rows that all ask for ``logprobs=5`` (greedy, fed the
same logits again and again): engine/sampler.py, and beside it the per-row sampler it replaced
(tests/sampler_reference.py) when that file is there. On the CPU this is mostly the log-softmax
and top-k themselves; the small-vocabulary line shows the per-row work that on a GPU would be
launches and syncs."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from batchery.engine.config import EngineConfig  # noqa: E402
from batchery.engine.llm_engine import LLMEngine  # noqa: E402
from batchery.engine.loader import LoadedModel  # noqa: E402
from batchery.engine.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sampler-rows", type=int, default=256)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    loaded = LoadedModel(model, None, cfg, torch.float32, torch.device("cpu"), "tiny")
    eng = LLMEngine(
        EngineConfig(model="tiny", dtype="float32", max_num_seqs=args.seqs, max_num_batched_tokens=16384), loaded=loaded
    )
    rng = random.Random(0)
    for i in range(args.seqs):
        eng.add_request(
            str(i),
            [rng.randrange(100, 40000) for _ in range(args.context)],
            SamplingParams(temperature=0, max_tokens=args.steps + 10, ignore_eos=True),
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()

    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    runner = eng.runner
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    runner.pack = timed("pack (host lists)", runner.pack)
    runner.prepare = timed("prepare (input tensors)", runner.prepare)
    runner.forward = timed("forward (tiny model, CPU)", runner.forward)
    runner.sampler = timed("sampler (CPU)", runner.sampler)
    eng.block_manager.register_full_blocks = timed("register_full_blocks", eng.block_manager.register_full_blocks)
    eng.stop_checker.check = timed("check_stop", eng.stop_checker.check)
    for _ in range(3):
        eng.step()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    total = (time.perf_counter() - t0) / args.steps
    print(f"torch {torch.__version__}; decode steps of {args.seqs} sequences, context ~{args.context}:")
    print(f"  {'whole step':28s} {total * 1e3:7.2f} ms")
    for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {t / args.steps * 1e3:7.2f} ms")
    host = sum(t for name, t in spent.items() if "CPU" not in name) / args.steps
    print(f"  {'host parts together':28s} {host * 1e3:7.2f} ms (everything above but forward and sampler)")
    for vocab in (cfg.vocab_size, 1024):
        sampler_section(args.sampler_rows, vocab)


def sampler_section(rows: int, vocab: int, logprobs: int = 5, calls: int = 10) -> None:
    """Milliseconds per sampler call at ``rows`` rows with ``logprobs`` each: the new sampler, and
    the reference (the old per-row one) if tests/sampler_reference.py can be imported."""
    from batchery.engine.sampler import Sampler
    from batchery.engine.sequence import Sequence

    samplers: list[tuple[str, type]] = []
    tests_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    sys.path.insert(0, tests_dir)
    try:
        from sampler_reference import ReferenceSampler

        samplers.append(("reference (per row)", ReferenceSampler))
    except ImportError:
        pass
    finally:
        sys.path.remove(tests_dir)
    samplers.append(("new (batched)", Sampler))
    rng = random.Random(0)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    figures = []
    for name, cls in samplers:
        sampler = cls(torch.device("cpu"))
        seqs = []
        for i in range(rows):
            s = Sequence(
                str(i), [rng.randrange(vocab) for _ in range(20)], SamplingParams(temperature=0, logprobs=logprobs)
            )
            seqs.append(s)
        for _ in range(2):
            sampler(logits.clone(), seqs, [0])
        times = []
        for _ in range(calls):
            x = logits.clone()
            t0 = time.perf_counter()
            sampler(x, seqs, [0])
            times.append(time.perf_counter() - t0)
        figures.append(f"{name} {sorted(times)[calls // 2] * 1e3:.2f} ms")
    label = f"sampler, {rows} rows with logprobs={logprobs}, vocab {vocab} (median per call)"
    print(f"  {label}: " + "; ".join(figures))


if __name__ == "__main__":
    main()
