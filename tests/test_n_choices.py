"""``SamplingParams(n=k)``: k choices of one request that share the prompt's KV blocks.

The first half drives the scheduler and block manager as the engine does, with a fake model (pure
Python, fast): when a choice forks, what it shares (reference counts), what it recomputes, and a
randomized workload with a model of the KV cache that checks every position a choice reads holds
its own prefix, through preemption, aborts and a pool too small for everyone. The second half runs
the engine on the tiny random-weight Llama: the prompt computed once, greedy choices equal to
``n=1``, seeded choices reproducible with choice 0 equal to ``n=1`` with the same seed, aborts,
preemption of a parent before its fork and of a forked choice after it, prefix caching off, and
``n=1`` and ``n=3`` requests mixed in one batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchery.engine.block_manager import BlockManager
from batchery.engine.outputs import ModelRunnerOutput
from batchery.engine.sampling import SamplingParams
from batchery.engine.scheduler import Scheduler, SchedulerOutput
from batchery.engine.sequence import RequestOutput, Sequence, SequenceStatus

# -- the scheduler, with a fake model ------------------------------------------------------------


def fake_model(out: SchedulerOutput) -> ModelRunnerOutput:
    """A token for each sequence the step completes; choices of one request draw different ones."""
    sampled = [
        s for s, n in zip(out.seqs, out.num_new_tokens, strict=True) if s.num_computed_tokens + n == s.num_tokens
    ]
    toks = [1 + (sum(s.token_ids) + 7 * s.index) % 3 for s in sampled]
    return ModelRunnerOutput(sampled, toks, [None] * len(sampled))


def length_stop(seq: Sequence, tok: int) -> str | None:
    return "length" if seq.num_output_tokens >= seq.params.max_tokens else None


class Sim:
    def __init__(self, num_blocks: int, block_size: int = 4, caching: bool = True, **limits: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, limits.get("max_num_seqs", 16), limits.get("max_num_batched_tokens", 1024))
        self.clock = 0.0
        self.history: list[list[tuple[str, int, int]]] = []  # per step: (request id, choice, tokens)

    def add(self, rid: str, prompt: list[int], n: int, max_tokens: int = 3, **kw) -> list[Sequence]:
        self.clock += 1.0
        params = SamplingParams(max_tokens=max_tokens, n=n)
        seqs = [Sequence(rid, prompt, params, arrival_time=self.clock, index=i, **kw) for i in range(n)]
        self.sched.add(seqs[0])
        for child in seqs[1:]:
            self.sched.add_fork(child, seqs[0])
        return seqs

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.history.append([(s.request_id, s.index, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)])
        self.sched.update_from_output(out, fake_model(out), length_stop)
        return out

    def run(self) -> None:
        for _ in range(1000):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not drain")

    def pool_full(self) -> bool:
        return self.bm.num_free_blocks == self.bm.num_blocks and self.bm.ref_counts == [0] * self.bm.num_blocks


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(("prompt_len", "shared"), [(10, 2), (8, 1), (3, 0), (1, 0)])
def test_choices_fork_the_full_prompt_blocks_once_the_parent_has_computed_the_prompt(prompt_len, shared, caching):
    sim = Sim(64, caching=caching)
    parent, *children = sim.add("r", list(range(1, prompt_len + 1)), n=3)
    out = sim.step()
    assert [(s.index, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)] == [(0, prompt_len)]
    # the parent sampled its first token in that step: the children forked its full prompt blocks
    assert sim.sched.num_forks == 2 and not sim.sched.unforked
    for c in children:
        assert c.block_table == parent.block_table[:shared]
        assert c.num_computed_tokens == shared * 4 and c.num_output_tokens == 0
    assert all(sim.bm.ref_counts[b] == 3 for b in parent.block_table[:shared])
    assert all(sim.bm.ref_counts[b] == 1 for b in parent.block_table[shared:])
    # next step: the parent decodes, each child recomputes only the prompt's tail and samples
    out = sim.step()
    tail = prompt_len - shared * 4
    assert 1 <= tail <= 4
    assert [(s.index, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)] == [(0, 1), (1, tail), (2, tail)]
    assert all(c.num_output_tokens == 1 for c in children)
    assert len({tuple(s.output_token_ids) for s in (parent, *children)}) > 1  # they drew their own tokens
    sim.run()
    assert all(s.is_finished and s.num_output_tokens == 3 for s in (parent, *children))
    assert sim.pool_full()


def test_children_wait_while_their_parent_is_preempted_before_the_fork():
    sim = Sim(64, max_num_batched_tokens=4)
    (old,) = sim.add("old", [9, 9], n=1, max_tokens=20)
    sim.step()
    parent, child = sim.add("r", list(range(1, 11)), n=2)
    sim.step()  # old decodes, the parent's prompt is computed in part (3 of 10 tokens)
    assert 0 < parent.num_computed_tokens < 10 and child in sim.sched.unforked[parent]
    assert sim.sched.set_step_limits(1, 4) == 1  # the newest running sequence goes: the parent
    assert parent.status == SequenceStatus.WAITING and parent.num_computed_tokens == 0
    assert child in sim.sched.unforked[parent] and child.block_table == []
    sim.sched.set_step_limits(16, 4)
    sim.run()
    # the child never ran before the parent had sampled its first token, and forked then
    first_sample = next(i for i, step in enumerate(sim.history) if any(r == "r" and c == 0 for r, c, _ in step))
    child_steps = [i for i, step in enumerate(sim.history) if ("r", 1) in [(r, c) for r, c, _ in step]]
    assert child_steps and min(child_steps) > first_sample
    assert sim.sched.num_forks == 1 and parent.num_preemptions == 1
    assert parent.is_finished and child.is_finished and old.is_finished
    assert sim.pool_full()


def test_a_parent_that_finishes_in_its_first_step_still_gives_its_children_the_blocks():
    sim = Sim(64)
    parent, *children = sim.add("r", list(range(1, 14)), n=3, max_tokens=1)
    sim.step()
    assert parent.is_finished and parent.block_table == []
    assert sim.sched.num_forks == 2
    shared = children[0].block_table
    assert len(shared) == 3 and all(sim.bm.ref_counts[b] == 2 for b in shared)  # the two children hold them
    out = sim.step()
    assert out.num_new_tokens == [1, 1]  # 13 tokens, 12 shared: each recomputes the last one
    assert all(c.is_finished for c in children)
    assert sim.pool_full()


def test_a_forked_choice_that_does_not_fit_gives_its_blocks_back_and_starts_over():
    sim = Sim(5)
    parent, child = sim.add("r", list(range(1, 10)), n=2, max_tokens=4)  # 9 tokens: 2 blocks shared, 1 own
    sim.step()
    assert child in sim.sched.forked and len(child.block_table) == 2
    dummy = Sequence("dummy", [0] * 8, SamplingParams())
    sim.bm.allocate(dummy, 8)  # 2 blocks pinned: the child's third block does not fit
    out = sim.step()
    assert [s.index for s in out.seqs] == [0]
    assert child in sim.sched.waiting and child.block_table == [] and child.num_computed_tokens == 0
    assert all(sim.bm.ref_counts[b] == 1 for b in parent.block_table)
    sim.bm.free_seq(dummy)
    sim.run()
    assert child.is_finished and child.num_output_tokens == 4
    assert sim.pool_full()


def test_removing_a_parent_before_the_fork_lets_its_children_start_on_their_own():
    sim = Sim(64)
    parent, *children = sim.add("r", list(range(1, 10)), n=3)
    sim.sched.finish(parent, "abort")
    assert not sim.sched.unforked and [s.index for s in sim.sched.waiting] == [1, 2]
    sim.run()
    assert all(c.is_finished and c.num_output_tokens == 3 for c in children) and sim.sched.num_forks == 0
    assert sim.pool_full()


def test_isolated_choices_run_in_steps_of_their_own():
    sim = Sim(64)
    (other,) = sim.add("other", [5, 6], n=1, max_tokens=6)
    seqs = sim.add("iso", list(range(1, 11)), n=3, isolated=True)
    sim.run()
    for step in sim.history:
        if any(r == "iso" for r, _, _ in step):
            assert len(step) == 1
    assert all(s.is_finished and s.num_output_tokens == 3 for s in seqs) and other.num_output_tokens == 6
    assert sim.sched.num_forks == 2 and not sim.sched.isolated
    assert sim.pool_full()


@dataclass
class Req:
    prompt: list[int]
    n: int
    max_tokens: int
    priority: int
    arrive_step: int
    isolated: bool


req_strategy = st.builds(
    Req,
    prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14),
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 6),
    priority=st.integers(0, 2),
    arrive_step=st.integers(0, 10),
    isolated=st.sampled_from([False, False, False, True]),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(req_strategy, min_size=1, max_size=6),
    num_blocks=st.integers(4, 14),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 16),
    caching=st.booleans(),
    abort_at=st.dictionaries(st.integers(0, 30), st.integers(0, 7), max_size=2),
)
def test_random_workloads_with_choices(reqs, num_blocks, block_size, max_num_seqs, budget, caching, abort_at):
    """Any mix of requests and choices, a pool often too small (preemption, forks given back),
    aborts of whole requests: every block reference is accounted for, every position a sequence
    reads holds the K/V of its own prefix (a forked choice reads its parent's prompt blocks), no
    step stalls, and every choice not aborted generates its tokens."""
    max_len = num_blocks * block_size
    bm = BlockManager(num_blocks, block_size, caching)
    sched = Scheduler(bm, max_num_seqs, budget)
    kv: dict[tuple[int, int], tuple[int, ...]] = {}  # slot -> the prefix whose last token it encodes
    pending = sorted(((r.arrive_step, i, r) for i, r in enumerate(reqs)), key=lambda t: (t[0], t[1]))
    groups: dict[str, list[Sequence]] = {}
    aborted: set[str] = set()

    def stop(seq: Sequence, tok: int) -> str | None:
        return "length" if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_len else None

    for step in range(3000):
        while pending and pending[0][0] <= step:
            _, i, r = pending.pop(0)
            params = SamplingParams(max_tokens=r.max_tokens, n=r.n)
            prompt = r.prompt[: max_len - 1]
            seqs = [Sequence(str(i), prompt, params, r.priority, float(i), r.isolated, index=k) for k in range(r.n)]
            groups[str(i)] = seqs
            sched.add(seqs[0])
            for c in seqs[1:]:
                sched.add_fork(c, seqs[0])
        live = [rid for rid, seqs in groups.items() if rid not in aborted and not all(s.is_finished for s in seqs)]
        if step in abort_at and live:
            rid = live[abort_at[step] % len(live)]
            for s in reversed(groups[rid]):
                if not s.is_finished:
                    sched.finish(s, "abort")
            aborted.add(rid)
        if not pending and not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= budget and len(sched.running) <= max_num_seqs
        if any(s.isolated for s in out.seqs):
            assert len(out.seqs) == 1
        if sched.has_unfinished() and not out.seqs:
            assert out.num_preempted > 0, "nothing scheduled and nothing preempted: stalled"
        counts = [0] * num_blocks
        for s in sched.running + sched.forked:
            for b in s.block_table:
                counts[b] += 1
        for s in sched.waiting + [c for cs in sched.unforked.values() for c in cs]:
            assert s.block_table == [] and s.status == SequenceStatus.WAITING
        assert bm.ref_counts == counts
        assert set(bm.free) == {b for b in range(num_blocks) if counts[b] == 0}
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
            t = s.block_table
            for p in range(s.num_computed_tokens):
                assert kv.get((t[p // block_size], p % block_size)) == tuple(s.token_ids[: p + 1]), (
                    f"request {s.request_id} choice {s.index} position {p} reads K/V of another prefix"
                )
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                assert bm.ref_counts[t[p // block_size]] == 1, "a sequence writes into a shared block"
                kv[(t[p // block_size], p % block_size)] = tuple(s.token_ids[: p + 1])
        sched.update_from_output(out, fake_model(out), stop)
    else:
        raise AssertionError("did not drain")
    for rid, seqs in groups.items():
        if rid in aborted:
            continue
        for s in seqs:
            assert s.is_finished and (s.num_output_tokens == s.params.max_tokens or s.num_tokens >= max_len)
    assert bm.num_free_blocks == num_blocks and bm.ref_counts == [0] * num_blocks


# -- the engine, on the tiny random-weight model ---------------------------------------------------

torch = pytest.importorskip("torch")

from batchery.engine.config import EngineConfig  # noqa: E402
from batchery.engine.llm import LLM  # noqa: E402
from batchery.engine.llm_engine import LLMEngine, choice_seed  # noqa: E402
from batchery.engine.loader import load_model  # noqa: E402

_rid = itertools.count()
WORDS = "the cat and the dog sat in the sun by the sea and a bird sang of rain and fire".split()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


def make_engine(tiny_model_dir, loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", **{"num_kv_blocks": 512, **kw}), loaded)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loaded):
    return make_engine(tiny_model_dir, loaded)


def prompt_of(eng: LLMEngine, num_words: int, salt: int = 0) -> list[int]:
    """A prompt of ``num_words`` tokens (one per word); ``salt`` makes it differ from the others."""
    words = [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(num_words)]
    ids = eng.encode(" ".join(words))
    assert len(ids) == num_words
    return ids


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 8, "ignore_eos": True, **kw})


def sample(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, **{"max_tokens": 8, "ignore_eos": True, **kw})


def drain(eng: LLMEngine, rids: list[str], outs: dict | None = None, watch=None) -> list[RequestOutput]:
    """Step until the engine is empty; each request gives one output; every block comes back."""
    outs = {} if outs is None else outs
    for _ in range(20_000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            assert o.request_id not in outs
            outs[o.request_id] = o
        if watch is not None:
            watch(eng)
    else:
        raise AssertionError("engine did not drain")
    st_ = eng.stats()
    assert st_["kv_blocks_free"] == st_["kv_blocks_total"], "KV blocks leaked"
    assert st_["num_running"] == st_["num_waiting"] == 0 and not eng.choices
    return [outs[r] for r in rids]


def generate(eng: LLMEngine, prompts: list[list[int]], params, watch=None) -> list[RequestOutput]:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rids.append(f"n{next(_rid)}")
        eng.add_request(rids[-1], p, sp)
    return drain(eng, rids, watch=watch)


def tokens(out: RequestOutput) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("caching", [True, False])
def test_n4_computes_a_long_prompt_once_and_greedy_choices_equal_n1(tiny_model_dir, loaded, caching):
    eng = make_engine(tiny_model_dir, loaded, enable_prefix_caching=caching)
    P = 301
    prompt = prompt_of(eng, P, salt=int(caching))
    (one,) = generate(eng, [prompt], greedy())
    before = eng.stats()
    rid = f"n{next(_rid)}"
    eng.add_request(rid, prompt, greedy(n=4))
    while not eng.stats()["num_forked_choices"] > before["num_forked_choices"]:
        eng.step()
    # the step in which choice 0 sampled its first token: the others hold its full prompt blocks
    parent = eng.requests[rid]
    shared = (P - 1) // 8
    refs = [eng.block_manager.ref_counts[b] for b in parent.block_table[:shared]]
    assert refs == [4] * shared
    (out,) = drain(eng, [rid])
    after = eng.stats()
    tail = P - shared * 8
    computed = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
    if caching:  # the n=1 run left the prompt's full blocks in the prefix cache: choice 0 hit them too
        assert computed == 4 * tail
        assert out.num_cached_tokens == shared * 8
    else:
        assert computed == P + 3 * tail < 4 * P / 3
        assert out.num_cached_tokens == 0
    assert after["num_forked_choices"] - before["num_forked_choices"] == 3
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == P  # the prompt counted once
    assert after["num_generated_tokens"] - before["num_generated_tokens"] == 4 * 8
    assert tokens(out) == [one.token_ids] * 4
    assert out.token_ids == one.token_ids and out.finish_reason == "length" and out.text == out.outputs[0].text
    assert all(c.finish_reason == "length" for c in out.outputs)


def test_seeded_choices_are_reproducible_differ_and_choice_0_is_n1(engine):
    prompt = prompt_of(engine, 37, salt=3)
    (a,) = generate(engine, [prompt], sample(n=4, seed=1234, max_tokens=12))
    (b,) = generate(engine, [prompt], sample(n=4, seed=1234, max_tokens=12))
    (single,) = generate(engine, [prompt], sample(seed=1234, max_tokens=12))
    assert tokens(a) == tokens(b)
    assert a.outputs[0].token_ids == single.token_ids == a.token_ids
    assert len({tuple(t) for t in tokens(a)}) == 4  # near-uniform model: 12 tokens never agree by chance
    # choice i samples as a lone request seeded with choice_seed(1234, i) would
    (third,) = generate(engine, [prompt], sample(seed=choice_seed(1234, 2), max_tokens=12))
    assert a.outputs[2].token_ids == third.token_ids
    assert choice_seed(1234, 0) == 1234 and len({choice_seed(1234, i) for i in range(16)}) == 16
    # amid other work the seeded choices stay the same
    other = prompt_of(engine, 20, salt=5)
    mixed = generate(engine, [other, prompt, other], [sample(n=2), sample(n=4, seed=1234, max_tokens=12), greedy()])
    assert tokens(mixed[1]) == tokens(a)
    # unseeded choices use the engine's generator: they differ from each other
    (u,) = generate(engine, [prompt], sample(n=3, max_tokens=12))
    assert len({tuple(t) for t in tokens(u)}) == 3


def test_abort_mid_way_frees_every_block(engine):
    free0 = engine.stats()["kv_blocks_free"]
    assert free0 == engine.stats()["kv_blocks_total"]
    rid = f"n{next(_rid)}"
    engine.add_request(rid, prompt_of(engine, 50, salt=7), greedy(n=4, max_tokens=30))
    keep = f"n{next(_rid)}"
    engine.add_request(keep, prompt_of(engine, 12, salt=8), greedy(max_tokens=10))
    for _ in range(4):
        assert engine.step() == []
    assert engine.stats()["num_running"] == 5 and engine.stats()["kv_blocks_free"] < free0
    assert engine.abort(rid) is True and rid not in engine.requests and rid not in engine.choices
    assert engine.stats()["num_running"] == 1
    assert engine.abort(rid) is False
    (kept,) = drain(engine, [keep])
    assert len(kept.token_ids) == 10
    assert engine.stats()["kv_blocks_free"] == free0
    # aborted before its fork: the waiting choices go with it
    rid = f"n{next(_rid)}"
    engine.add_request(rid, prompt_of(engine, 50, salt=9), greedy(n=3))
    assert engine.stats()["num_waiting"] == 3
    assert engine.abort(rid) is True
    assert not engine.has_unfinished() and engine.stats()["num_waiting"] == 0
    assert engine.stats()["kv_blocks_free"] == free0


def test_preempted_parent_before_fork_and_preempted_forks_give_the_large_pool_outputs(engine, tiny_model_dir, loaded):
    """A pool of 14 blocks for requests that need many more: the parent of an n=3 request is
    preempted while its prompt is being computed (chunks of 8 tokens) and forked choices are
    preempted after their fork; greedy outputs are those of a pool that holds everything."""
    prompts = [prompt_of(engine, 30, salt=s) for s in range(4)]
    params = [greedy(max_tokens=40), greedy(n=3, max_tokens=24), greedy(n=2, max_tokens=30), greedy(max_tokens=20)]
    reference = [tokens(o) for o in generate(engine, prompts, params)]
    small = make_engine(tiny_model_dir, loaded, num_kv_blocks=14, max_num_batched_tokens=8, max_num_seqs=8)
    seen = {"parent_before_fork": False, "fork_after": False}

    def watch(eng: LLMEngine) -> None:
        sch = eng.scheduler
        for parent in sch.unforked:
            seen["parent_before_fork"] |= parent.num_preemptions > 0
        for seqs in eng.choices.values():
            seen["fork_after"] |= any(s.index > 0 and s.num_preemptions > 0 for s in seqs)

    got = [tokens(o) for o in generate(small, prompts, params, watch=watch)]
    assert seen == {"parent_before_fork": True, "fork_after": True}
    assert small.stats()["num_preemptions"] > 0
    assert got == reference
    assert all(len(set(map(tuple, t))) == 1 for t in got)  # greedy: the choices agree


def test_n1_and_n3_requests_mixed_in_one_batch(engine):
    prompts = [prompt_of(engine, k, salt=k) for k in (9, 17, 24, 33)]
    alone = [generate(engine, [p], greedy(max_tokens=6))[0].token_ids for p in prompts]
    seeded_alone = generate(engine, [prompts[1]], sample(seed=5, n=3, max_tokens=6))[0]
    mix = generate(
        engine,
        prompts + [prompts[1]],
        [greedy(max_tokens=6), greedy(n=3, max_tokens=6), greedy(max_tokens=6), greedy(n=3, max_tokens=6)]
        + [sample(seed=5, n=3, max_tokens=6)],
    )
    assert [len(o.outputs) for o in mix] == [1, 3, 1, 3, 3]
    for o, ref in zip(mix, alone, strict=False):
        assert all(t == ref for t in tokens(o))
    assert tokens(mix[4]) == tokens(seeded_alone)


def test_choices_end_on_their_own_and_the_request_when_all_have(engine):
    """Per-choice stop handling: each choice ends at its own EOS or length; the request's output
    comes when the last one does; choice 0's fields are the flat ones."""
    prompt = prompt_of(engine, 15, salt=11)
    eos = engine.eos_ids[0]
    (o,) = generate(engine, [prompt], SamplingParams(n=8, max_tokens=60, seed=3, logprobs=1))
    lens = [len(c.token_ids) for c in o.outputs]
    assert len(set(lens)) > 1  # some choices reach EOS (this seed) and others their length
    for c in o.outputs:
        assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == eos)
    assert (o.token_ids, o.text, o.finish_reason, o.logprobs) == (
        o.outputs[0].token_ids,
        o.outputs[0].text,
        o.outputs[0].finish_reason,
        o.outputs[0].logprobs,
    )


def test_isolated_request_with_choices(engine):
    prompt = prompt_of(engine, 21, salt=12)
    (ref,) = generate(engine, [prompt], greedy())
    rid = f"n{next(_rid)}"
    engine.add_request(rid, prompt, greedy(n=3), isolated=True)
    (o,) = drain(engine, [rid])
    assert tokens(o) == [ref.token_ids] * 3


def test_each_constrained_choice_has_its_own_grammar_state(engine):
    pytest.importorskip("xgrammar")
    prompt = prompt_of(engine, 10, salt=13)
    options = ["cat", "dog", "fire", "rain"]  # one token each: the word-level vocabulary has no spaces
    rid = f"n{next(_rid)}"
    engine.add_request(
        rid, prompt, sample(n=5, seed=9, max_tokens=10, ignore_eos=False, structured_outputs={"choice": options})
    )
    grammars = [s.grammar for s in engine.choices[rid]]
    assert all(g is not None for g in grammars) and len({id(g) for g in grammars}) == 5
    (o,) = drain(engine, [rid])
    assert all(c.text in options and c.finish_reason == "stop" for c in o.outputs), o.outputs
    assert len({c.text for c in o.outputs}) > 1  # each grammar state advanced with its own choice's tokens
    st_ = engine.stats()
    assert st_["grammar_compiled"] >= 1 and "grammar_cache_hits" in st_


def test_logit_bias_ids_outside_the_vocabulary_are_refused(engine):
    vocab = engine.runner.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token ids {vocab}, {vocab + 1} are .*vocabulary of {vocab} "):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={vocab + 1: 1.0, vocab: -1.0, 3: 2.0}))
    with pytest.raises(ValueError, match=r"\.\.\."):
        engine.add_request("bad", [1, 2], SamplingParams(logit_bias={vocab + i: 1.0 for i in range(6)}))
    assert "bad" not in engine.requests
    engine.add_request("ok", [1, 2], greedy(logit_bias={vocab - 1: 1.0}, max_tokens=2))
    drain(engine, ["ok"])


def test_llm_generate_returns_one_output_per_prompt_with_n_choices(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256)
    too_long = [5] * (llm.engine.max_model_len + 1)
    outs = llm.generate(["the cat sat", too_long], SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True))
    assert len(outs) == 2
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 1 and len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "error" and all(c.finish_reason == "error" for c in outs[1].outputs)
    assert outs[1].error and "max_model_len" in outs[1].error
    chats = llm.chat([[{"role": "user", "content": "hello"}]], SamplingParams(n=2, max_tokens=3))
    assert len(chats) == 1 and [c.index for c in chats[0].outputs] == [0, 1]
