"""Host-side cost of one engine step with many sequences: what the CPU spends around the model.

    python benchmarks/step_overhead.py [--seqs 512] [--context 200]

Runs decode steps of ``--seqs`` sequences on a one-layer random-weight model (SmolLM2's vocabulary,
tiny hidden size), so the model's forward is cheap and the scheduler, batch packing, input tensors,
block bookkeeping and output handling show. On a GPU these run while the device would otherwise
wait, so at large batches they bound the step rate.

The figure is "host time per step": the whole step less the model's forward and the sampler,
with only those two timed, so nothing else is instrumented; the median over the steps, with the
min and mean beside it (on a shared machine a step is now and then descheduled, and noise only
adds: there the min is the steadier figure). The forward's freed output counts with the forward.
Then a second run with every part timed shows where
that time goes; its per-sequence parts (register_full_blocks, check_stop: once per sequence) carry
the cost of their own timers. "forward" and "sampler" are CPU figures for the tiny model and say
little about a GPU.

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

FORWARD = "forward (tiny model, CPU)"


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
            SamplingParams(temperature=0, max_tokens=2 * args.steps + 20, ignore_eos=True),
        )
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()

    print(f"torch {torch.__version__}; {cpu_name()}; decode steps of {args.seqs} sequences, context ~{args.context}:")
    runner = eng.runner
    originals = {
        "schedule": (eng.scheduler, "schedule"),
        "pack (host arrays)": (runner, "pack"),
        "prepare (input tensors)": (runner, "prepare"),
        FORWARD: (runner, "forward"),
        "sampler (CPU)": (runner, "sampler"),
        "register_full_blocks": (eng.block_manager, "register_full_blocks"),
        "check_stop": (eng.stop_checker, "check"),
    }
    device_parts = (FORWARD, "sampler (CPU)")

    # 1. The figure: host time per step = the whole step less the model's forward and the sampler, with only those
    # two wrapped (two timer pairs a step); everything else the step does is in it, un-instrumented.
    per_step = run_steps(eng, originals, device_parts, args.steps)
    whole = [d["whole step"] for d in per_step]
    host = [d["whole step"] - d[FORWARD] - d["sampler (CPU)"] for d in per_step]
    print(f"  {'whole step':28s} {median(whole) * 1e3:7.2f} ms (median of {args.steps} steps)")
    print(
        f"  {'host time per step':28s} {median(host) * 1e3:7.2f} ms median, {min(host) * 1e3:.2f} min, "
        f"{sum(host) / len(host) * 1e3:.2f} mean (the step less forward and sampler)"
    )
    # 2. Where it goes: every part wrapped (the per-sequence ones, register_full_blocks and check_stop, are called once
    # per sequence, so their figures include a few hundred timer pairs of their own).
    per_step = run_steps(eng, originals, list(originals), args.steps)
    for name in sorted(originals, key=lambda k: -median([d[k] for d in per_step])):
        print(f"  {name:28s} {median([d[name] for d in per_step]) * 1e3:7.2f} ms")
    parts = [sum(t for k, t in d.items() if k in originals and k not in device_parts) for d in per_step]
    print(f"  {'host parts together':28s} {median(parts) * 1e3:7.2f} ms (the parts above but forward and sampler)")
    for vocab in (cfg.vocab_size, 1024):
        sampler_section(args.sampler_rows, vocab)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"


def run_steps(eng, originals: dict, wrapped, steps: int) -> list[dict[str, float]]:
    """``steps`` engine steps (after 3 unmeasured) with the parts named in ``wrapped`` timed; per step, seconds by
    part, and "whole step" for the step less the wrapped parts. The originals are put back afterwards."""
    saved = {name: getattr(obj, attr) for name, (obj, attr) in originals.items()}
    own = {name: vars(obj)[attr] for name, (obj, attr) in originals.items() if attr in vars(obj)}
    spent: dict[str, float] = {}

    held: list[object] = [None]

    def timed(name, fn):
        hold = name == FORWARD

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                if hold:
                    # The last step's logits are freed here, inside the forward's time: on the CPU, giving a
                    # [256, 49152] fp32 tensor back to the OS takes ~17 ms (munmap), which would otherwise land in
                    # the host time; on a GPU the caching allocator keeps it.
                    held[0] = None
                    out = held[0] = fn(*a, **k)
                    return out
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    for name in wrapped:
        obj, attr = originals[name]
        setattr(obj, attr, timed(name, saved[name]))
    try:
        for _ in range(3):
            eng.step()
        out = []
        for _ in range(steps):
            spent.clear()
            t0 = time.perf_counter()
            eng.step()
            total = time.perf_counter() - t0
            d = {name: spent.get(name, 0.0) for name in wrapped}
            d["whole step"] = total
            out.append(d)
        return out
    finally:
        held[0] = None
        for name in wrapped:
            obj, attr = originals[name]
            if name in own:  # an instance attribute before (a callable object such as the sampler)
                setattr(obj, attr, own[name])
            else:  # a method: drop the wrapper that shadowed it
                delattr(obj, attr)


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
