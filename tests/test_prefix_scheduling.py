"""Requests that share a prefix nobody has computed yet compute it once: a waiting request whose next uncached
prompt block a running sequence is computing is held back (``Scheduler._hold``) until that block is in the prefix
cache, without holding up the requests behind it, and never for good.

The first half drives the scheduler and block manager with a fake model (pure Python); the second runs the engine
on the tiny random-weight Llama: three requests sharing a five-block prefix compute it once, their greedy outputs
are those of each run alone, and a holder that is preempted or aborted leaves nobody stuck."""

from __future__ import annotations

import itertools
import random

import pytest

from batchery.engine import scheduler as scheduler_module
from batchery.engine.block_manager import BlockManager
from batchery.engine.outputs import ModelRunnerOutput
from batchery.engine.sampling import SamplingParams
from batchery.engine.scheduler import Scheduler, SchedulerOutput
from batchery.engine.sequence import Sequence, SequenceStatus

# -- the scheduler, with a fake model ------------------------------------------------------------


def fake_model(out: SchedulerOutput) -> ModelRunnerOutput:
    sampled = [
        s for s, n in zip(out.seqs, out.num_new_tokens, strict=True) if s.num_computed_tokens + n == s.num_tokens
    ]
    return ModelRunnerOutput(sampled, [1 + sum(s.token_ids) % 5 for s in sampled], [None] * len(sampled))


def length_stop(seq: Sequence, tok: int) -> str | None:
    return "length" if seq.num_output_tokens >= seq.params.max_tokens else None


class Sim:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, caching: bool = True, **limits: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, limits.get("max_num_seqs", 16), limits.get("max_num_batched_tokens", 1024))
        self.clock = 0.0
        self.computed: dict[str, int] = {}  # request id -> prompt tokens computed (recomputations included)
        self.steps: list[list[str]] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3, isolated: bool = False) -> Sequence:
        self.clock += 1.0
        seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=self.clock, isolated=isolated)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
            prompt_part = max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
            self.computed[s.request_id] = self.computed.get(s.request_id, 0) + prompt_part
        self.steps.append([s.request_id for s in out.seqs])
        self.sched.update_from_output(out, fake_model(out), length_stop)
        return out

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                assert self.bm.num_free_blocks == self.bm.num_blocks and set(self.bm.ref_counts) == {0}
                return
            self.step()
        raise AssertionError("did not drain")


SHARED = list(range(100, 120))  # five blocks of 4


def test_three_requests_sharing_a_five_block_prefix_compute_it_once():
    sim = Sim()
    seqs = [sim.add(f"q{i}", SHARED + [i, i + 1, i + 2]) for i in range(3)]
    sim.step()
    assert sim.steps[0] == ["q0"]  # the others wait for q0's prefix
    assert all(s.status == SequenceStatus.WAITING for s in seqs[1:])
    sim.run()
    assert sim.computed == {"q0": 23, "q1": 3, "q2": 3}
    assert [s.num_cached_tokens for s in seqs] == [0, 20, 20]
    assert sim.sched.num_prefix_waits == 2


def test_chunked_prefill_the_others_wait_for_the_holders_last_chunk():
    # a chunk takes the whole budget until the last one: that step computes blocks the others would need
    sim = Sim(max_num_batched_tokens=16)
    seqs = [sim.add(f"q{i}", SHARED + [i] * 5) for i in range(3)]
    sim.run()
    assert sim.computed == {"q0": 25, "q1": 5, "q2": 5}
    assert [s.num_cached_tokens for s in seqs] == [0, 20, 20]
    assert [s.num_prefix_waits for s in seqs] == [0, 1, 1]


def test_partly_shared_prompts_hit_what_is_shared_and_compute_the_rest():
    sim = Sim()
    a = sim.add("a", SHARED + [1, 2, 3])
    b = sim.add("b", SHARED[:12] + [7] * 11)  # three blocks in common with a
    sim.run()
    assert sim.computed == {"a": 23, "b": 11}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)


def test_requests_behind_a_held_one_are_not_held_up():
    sim = Sim()
    sim.add("a0", SHARED + [1])
    sim.add("a1", SHARED + [2])
    sim.add("other", list(range(200, 221)))
    sim.add("a2", SHARED + [3])
    sim.step()
    assert sim.steps[0] == ["a0", "other"]
    sim.step()
    assert sim.steps[1] == ["a0", "other", "a1", "a2"]  # FCFS among the released ones
    sim.run()
    assert sim.computed == {"a0": 21, "a1": 1, "a2": 1, "other": 21}


def test_no_hold_without_prefix_caching():
    sim = Sim(caching=False)
    for i in range(3):
        sim.add(f"q{i}", SHARED + [i])
    sim.step()
    assert sim.steps[0] == ["q0", "q1", "q2"]
    sim.run()
    assert sim.sched.num_prefix_waits == 0


def test_an_isolated_holder_holds_the_others_across_its_steps():
    # an isolated holder computes its prefill in steps of its own: the others wait through all of them
    sim = Sim(max_num_batched_tokens=4)
    sim.add("h", SHARED + [1], isolated=True)
    w = sim.add("w", SHARED + [2])
    sim.run()
    assert w.num_prefix_waits == 4 and w.num_cached_tokens == 20  # until h has published block 5
    assert sim.computed == {"h": 21, "w": 1}


def test_the_hold_is_bounded(monkeypatch):
    monkeypatch.setattr(scheduler_module, "MAX_PREFIX_WAIT_STEPS", 3)
    sim = Sim(max_num_batched_tokens=4)
    sim.add("h", SHARED + [1], isolated=True)
    w = sim.add("w", SHARED + [2])
    for _ in range(5):
        sim.step()
    assert w.num_prefix_waits == 3 and w.status == SequenceStatus.RUNNING
    sim.run()
    assert w.is_finished


def test_a_preempted_holder_goes_back_in_line_and_the_others_still_wait_for_it():
    sim = Sim(max_num_batched_tokens=8, max_num_seqs=4)
    x = sim.add("x", list(range(300, 305)), max_tokens=30)
    h = sim.add("h", SHARED + [1, 2, 3])
    w = sim.add("w", SHARED + [4, 5, 6])
    sim.step()
    sim.step()
    assert h.status == SequenceStatus.RUNNING and 0 < h.num_computed_tokens < 20
    assert sim.sched.set_step_limits(1, 8) == 1 and h.status == SequenceStatus.WAITING  # the newest goes
    sim.step()
    sim.sched.set_step_limits(4, 8)
    sim.run()
    assert x.is_finished and h.is_finished and w.is_finished
    assert w.num_cached_tokens == 20 and sim.computed["w"] == 3
    assert h.num_cached_tokens > 0  # its blocks published before the preemption stayed in the cache


def test_an_aborted_holder_leaves_the_rest_to_the_next_in_line():
    sim = Sim(max_num_batched_tokens=4)
    h = sim.add("h", SHARED + [1], isolated=True)
    w1 = sim.add("w1", SHARED + [2])
    w2 = sim.add("w2", SHARED + [3])
    for _ in range(2):
        sim.step()
    assert w1.num_prefix_waits and w1.status == SequenceStatus.WAITING
    published = len(h.block_hashes)
    sim.sched.finish(h, "abort")
    sim.run()
    assert w1.num_cached_tokens == 4 * published  # w1 computes what h had not published
    assert w2.num_cached_tokens == 20  # and w2 waits for w1
    assert sim.computed["w2"] == 1


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_shared_prefixes_drain_and_compute_each_prefix_about_once(seed):
    rng = random.Random(seed)
    docs = [[1000 * (d + 1) + t for t in range(rng.randrange(8, 40))] for d in range(4)]
    sim = Sim(
        num_blocks=rng.choice([24, 64, 256]),
        block_size=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 32, 256]),
        max_num_seqs=rng.choice([2, 4, 16]),
    )
    seqs = []
    for i in range(16):
        seqs.append(sim.add(f"r{i}", docs[rng.randrange(4)] + [rng.randrange(1, 50) for _ in range(3)], 4))
        if rng.random() < 0.3:
            sim.step()
    aborted = rng.choice([None, *seqs[:4]])
    for _ in range(3):
        sim.step()
    if aborted is not None and not aborted.is_finished:
        sim.sched.finish(aborted, "abort")
    sim.run()
    assert all(s.is_finished for s in seqs)


# -- the engine, on the tiny random-weight Llama --------------------------------------------------

torch = pytest.importorskip("torch")

from batchery.engine.config import EngineConfig  # noqa: E402
from batchery.engine.llm_engine import LLMEngine  # noqa: E402
from batchery.engine.loader import load_model  # noqa: E402

_rid = itertools.count()
WORDS = "the cat and the dog sat in the sun by the sea and a bird sang of rain and fire".split()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(EngineConfig(model=str(tiny_model_dir), dtype="float32"))


def make_engine(tiny_model_dir, loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", **{"num_kv_blocks": 256, **kw}), loaded)


def words(eng: LLMEngine, n: int, salt: int) -> list[int]:
    ids = eng.encode(" ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n)))
    assert len(ids) == n
    return ids


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_all(eng: LLMEngine, prompts, params, watch=None) -> list:
    rids = [f"p{next(_rid)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        eng.add_request(rid, p, sp)
    outs = {}
    for _ in range(20_000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            outs[o.request_id] = o
        if watch is not None:
            watch(eng, rids)
    else:
        raise AssertionError("engine did not drain")
    st = eng.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    return [outs.get(r) for r in rids]


def alone(tiny_model_dir, loaded, prompts, params) -> list[list[int]]:
    """Each request on its own, in an engine without prefix caching."""
    eng = make_engine(tiny_model_dir, loaded, enable_prefix_caching=False)
    return [run_all(eng, [p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("chunk", [1024, 16])
def test_engine_three_requests_sharing_a_five_block_prefix_compute_it_once(tiny_model_dir, loaded, chunk):
    eng = make_engine(tiny_model_dir, loaded, max_num_batched_tokens=chunk)
    bs = eng.config.block_size
    prefix = words(eng, 5 * bs, salt=1)
    prompts = [prefix + words(eng, 3 + i, salt=10 + i) for i in range(3)]
    params = [greedy()] * 3
    before = eng.stats()["num_prompt_tokens_computed"]
    outs = run_all(eng, prompts, params)
    computed = eng.stats()["num_prompt_tokens_computed"] - before
    assert computed == 5 * bs + 3 + 4 + 5
    assert [o.num_cached_tokens for o in outs] == [0, 5 * bs, 5 * bs]
    assert [o.token_ids for o in outs] == alone(tiny_model_dir, loaded, prompts, params)


def test_engine_preempted_holder_no_deadlock_same_outputs(tiny_model_dir, loaded):
    eng = make_engine(tiny_model_dir, loaded, num_kv_blocks=20, max_num_batched_tokens=8, max_num_seqs=4)
    bs = eng.config.block_size
    prefix = words(eng, 5 * bs, salt=2)
    prompts = [words(eng, 6, salt=5)] + [prefix + words(eng, 4, salt=20 + i) for i in range(3)]
    params = [greedy(60), greedy(30), greedy(30), greedy(30)]
    rids = [f"p{next(_rid)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        eng.add_request(rid, p, sp)
    eng.step()
    eng.step()
    holder = eng.requests[rids[1]]
    assert 0 < holder.num_computed_tokens < 5 * bs
    assert eng.scheduler.set_step_limits(1, 8) == 1 and holder.num_preemptions == 1
    outs = {}
    for _ in range(5000):  # the engine puts its limits back by itself (as after an out-of-memory step)
        if not eng.has_unfinished():
            break
        for o in eng.step():
            outs[o.request_id] = o
    else:
        raise AssertionError("engine did not drain")
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]
    assert eng.stats()["num_preemptions"] >= 1
    assert [outs[r].token_ids for r in rids] == alone(tiny_model_dir, loaded, prompts, params)


def test_engine_aborted_holder_releases_the_others(tiny_model_dir, loaded):
    eng = make_engine(tiny_model_dir, loaded, max_num_batched_tokens=8)
    bs = eng.config.block_size
    prefix = words(eng, 5 * bs, salt=3)
    prompts = [prefix + words(eng, 3, salt=30 + i) for i in range(3)]
    rids = [f"p{next(_rid)}" for _ in prompts]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(rid, p, greedy())
    eng.step()
    eng.step()
    assert eng.stats()["num_running"] == 1
    assert eng.abort(rids[0])
    outs = {}
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            outs[o.request_id] = o
    assert set(outs) == set(rids[1:])
    assert outs[rids[1]].num_cached_tokens == 2 * bs  # what the aborted one had published
    assert outs[rids[2]].num_cached_tokens == 5 * bs  # the second computed the rest, the third hit it
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]
    got = [outs[r].token_ids for r in rids[1:]]
    assert got == alone(tiny_model_dir, loaded, prompts[1:], [greedy()] * 2)


def docqa_computed(tiny_model_dir, loaded, *, grouped: bool, num_kv_blocks: int, concurrency: int = 6):
    """Document questions (16 documents of 80 words, 3 questions each, shuffled) fed to an engine as a worker
    does, at most ``concurrency`` at a time in queue order; ``grouped``: in the submitter's order
    (``batchery.jobs.grouping.prefix_key``). Returns (prompt tokens computed, the minimum: each distinct prefix
    once, the size of the prompts' token trie)."""
    from batchery.jobs.grouping import prefix_key

    eng = make_engine(tiny_model_dir, loaded, num_kv_blocks=num_kv_blocks, max_num_seqs=16, max_num_batched_tokens=256)
    rng = random.Random(0)
    lines = []
    for _ in range(16):
        doc = " ".join(rng.choice(WORDS) for _ in range(80))
        lines += [(doc, " ".join(rng.choice(WORDS) for _ in range(3 + q))) for q in range(3)]
    rng.shuffle(lines)
    if grouped:
        chat = "/v1/chat/completions"
        lines.sort(
            key=lambda x: prefix_key(chat, {"messages": [{"role": "system", "content": x[0]}, {"content": x[1]}]})
        )
    prompts = [eng.encode(f"{doc} . {q}") for doc, q in lines]
    minimum = len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})
    queue = iter(prompts)

    def feed() -> None:
        p = next(queue, None)
        if p is not None:
            eng.add_request(f"p{next(_rid)}", p, greedy())

    for _ in range(concurrency):
        feed()
    for _ in range(20_000):
        if not eng.has_unfinished():
            break
        for _ in eng.step():
            feed()
    assert eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"]
    return eng.stats()["num_prompt_tokens_computed"], minimum


def test_docqa_grouped_computes_each_document_about_once_with_a_pool_too_small_for_all(
    tiny_model_dir, loaded, monkeypatch
):
    # 60 blocks of 8 tokens hold about 5 of the 16 documents (about 85 tokens each)
    computed, minimum = docqa_computed(tiny_model_dir, loaded, grouped=True, num_kv_blocks=60)
    assert computed <= 1.3 * minimum
    shuffled, _ = docqa_computed(tiny_model_dir, loaded, grouped=False, num_kv_blocks=60)
    assert shuffled > 1.5 * minimum  # the pool cannot hold every document: order matters
    monkeypatch.setattr(scheduler_module, "MAX_PREFIX_WAIT_STEPS", 0)
    unheld, _ = docqa_computed(tiny_model_dir, loaded, grouped=True, num_kv_blocks=60)
    assert unheld > 1.3 * minimum  # grouped, but each question of a document computing it at once
