"""The persistent batch (engine/persistent_batch.py): block-table rows kept from step to step, and
the runner's packing that reads them (issue 17 item 1).

The rows are checked against a from-scratch rebuild (every table zero-padded, as the runner did
before) after random joins, leaves, new blocks, preemptions and forks on the real block manager;
then every step of real engine runs (with preemption, prefix caching, forks and aborts) is packed
both ways and compared field by field."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from batchery.engine.block_manager import BlockManager
from batchery.engine.persistent_batch import PersistentBatch
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import Sequence


def rebuilt(tables: list[list[int]], width: int) -> np.ndarray:
    """Block tables zero-padded to ``width``: what a from-scratch rebuild gives."""
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_a_rebuild_after_random_changes(seed):
    rng = random.Random(seed)
    bs, max_seqs, max_blocks = 4, 8, 12
    bm = BlockManager(num_blocks=64, block_size=bs, enable_prefix_caching=seed % 2 == 0)
    batch = PersistentBatch(max_seqs, max_blocks)
    live: list[Sequence] = []
    waiting: list[Sequence] = []
    shared = [rng.randrange(50) for _ in range(9)]
    n_new = 0
    for step in range(400):
        op = rng.random()
        if op < 0.15 and len(live) + len(waiting) < 3 * max_seqs:  # a new sequence
            prompt = (shared if rng.random() < 0.4 else []) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            waiting.append(Sequence(f"r{n_new}", prompt, SamplingParams(max_tokens=40)))
            n_new += 1
        elif op < 0.25 and live:  # finished or aborted: blocks freed, the sequence gone
            seq = live.pop(rng.randrange(len(live)))
            bm.free_seq(seq)
        elif op < 0.33 and live:  # preempted: blocks freed (a new empty table), back to waiting
            seq = live.pop(rng.randrange(len(live)))
            bm.free_seq(seq)
            waiting.append(seq)
        elif op < 0.38 and live:  # a fork of a running sequence's full prompt blocks
            parent = rng.choice(live)
            child = Sequence(parent.request_id + "c", parent.prompt_token_ids, parent.params, index=1)
            if parent.num_computed_tokens >= parent.num_prompt_tokens:
                bm.fork(parent, child)
                if bm.can_allocate(child, child.num_uncomputed_tokens):
                    bm.allocate(child, child.num_uncomputed_tokens)
                    live.append(child)
                else:
                    bm.free_seq(child)
        # admit waiting sequences while there is room
        while waiting and len(live) < 2 * max_seqs:
            seq = waiting[0]
            bm.match_prefix(seq)
            n = seq.num_uncomputed_tokens
            if not bm.can_allocate(seq, n):
                bm.free_seq(seq)
                break
            bm.allocate(seq, n)
            waiting.pop(0)
            live.append(seq)
        # the step: some of the live sequences (at most max_seqs); each computes its tokens and may grow
        step_seqs = rng.sample(live, min(len(live), rng.randrange(1, max_seqs + 1)))
        if not step_seqs:
            continue
        for seq in step_seqs:
            seq.num_computed_tokens = seq.num_tokens
            if rng.random() < 0.7 and seq.num_tokens < bs * max_blocks:
                seq.token_ids.append(rng.randrange(50))
                if bm.can_allocate(seq, 1):
                    bm.allocate(seq, 1)
                else:
                    seq.token_ids.pop()
            bm.register_full_blocks(seq)
        batch.begin_step()
        rows = np.array([batch.row(s) for s in step_seqs], dtype=np.intp)
        assert len(set(rows.tolist())) == len(rows), "two sequences of one step share a row"
        want = rebuilt([s.block_table for s in step_seqs], max_blocks)
        assert (batch.tables[rows] == want).all(), f"step {step}: rows differ from a rebuild"
        width = max(len(s.block_table) for s in step_seqs) or 1
        assert (batch.gather(rows) == want[:, :width]).all()
        assert batch.num_blocks[rows].tolist() == [len(s.block_table) for s in step_seqs]
    assert batch.num_tail_writes > 0 and batch.num_row_writes > 0
    # rows were swept and reused (more sequences went through than there are rows)
    assert n_new > batch.max_rows


def test_steady_decode_writes_only_new_blocks():
    """A sequence that keeps decoding costs one tail write each time it gains a block, never a
    whole row; its row stays the same."""
    bm = BlockManager(num_blocks=32, block_size=4)
    batch = PersistentBatch(2, 16)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=40))
    bm.match_prefix(seq)
    bm.allocate(seq, 3)
    batch.begin_step()
    r = batch.row(seq)
    assert (batch.num_row_writes, batch.num_tail_writes) == (1, 0)
    for i in range(20):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(i)
        bm.allocate(seq, 1)
        batch.begin_step()
        assert batch.row(seq) == r
    assert batch.num_row_writes == 1
    assert batch.num_tail_writes == len(seq.block_table) - 1 == 5
    assert batch.tables[r, : len(seq.block_table)].tolist() == seq.block_table
    assert not batch.tables[r, len(seq.block_table) :].any()
    seq.block_table = [7, 9]  # replaced by a shorter list: the rest of the row is zeroed
    batch.begin_step()
    assert batch.row(seq) == r and batch.num_row_writes == 2
    assert batch.tables[r].tolist() == [7, 9] + [0] * 14


def test_sweep_keeps_rows_of_the_current_step():
    """When no row is free, the rows the current step has not used are released, never one it
    already handed out (even one it handed out through the fast path, without a write)."""
    batch = PersistentBatch(2, 4)  # 4 rows
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(8)]
    for i, s in enumerate(seqs):
        s.block_table = [i + 1]
    batch.begin_step()
    first = [batch.row(s) for s in seqs[:4]]  # every row taken
    batch.begin_step()
    kept = [batch.row(s) for s in seqs[:2]]  # fast path: no write
    assert kept == first[:2]
    new = [batch.row(s) for s in seqs[4:6]]  # a sweep frees the rows of seqs 2 and 3 only
    assert set(new) == set(first[2:])
    assert batch.tables[kept + new, 0].tolist() == [1, 2, 5, 6]
    assert seqs[2] not in batch.row_of and seqs[3] not in batch.row_of
    batch.begin_step()
    with pytest.raises(RuntimeError):
        for s in seqs[:5]:  # five sequences in one step of a batch sized for two (4 rows)
            batch.row(s)


def test_table_longer_than_a_row_is_refused():
    batch = PersistentBatch(1, 2)
    seq = Sequence("a", [1], SamplingParams())
    seq.block_table = [1, 2, 3]
    batch.begin_step()
    with pytest.raises(ValueError, match="does not fit"):
        batch.row(seq)


# -- the runner's packing against a from-scratch rebuild, on every step of real runs -------------


def reference_pack(runner, seqs, num_new_tokens):
    """The runner's packing as it was before the persistent batch: host lists, rebuilt per step."""
    bs = runner.block_size
    order = sorted(range(len(seqs)), key=lambda i: not (num_new_tokens[i] == 1 and seqs[i].num_computed_tokens > 0))
    ids, pos, slots, keep, samples, dec_tables, dec_lens, prefills = [], [], [], [], [], [], [], []
    for i in order:
        seq, n = seqs[i], num_new_tokens[i]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        q_start = len(ids)
        ids.extend(seq.token_ids[start:end])
        pos.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[q // bs] * bs + q % bs for q in range(start, end))
        if n == 1 and start > 0:
            dec_tables.append(list(table))
            dec_lens.append(end)
        else:
            prefills.append((q_start, n, end, list(table)))
        if end == seq.num_tokens:
            keep.append(q_start + n - 1)
            samples.append(seq)
    return ids, pos, slots, keep, samples, dec_tables, dec_lens, prefills


def check_pack(runner, seqs, num_new_tokens, p):
    ids, pos, slots, keep, samples, dec_tables, dec_lens, prefills = reference_pack(runner, seqs, num_new_tokens)
    assert p.input_ids.tolist() == ids
    assert p.positions.tolist() == pos
    assert p.slots.tolist() == slots
    assert p.logits_idx.tolist() == keep
    assert p.sample_seqs == samples
    assert p.decode_lens.tolist() == dec_lens
    if dec_tables:
        width = max(map(len, dec_tables))
        assert p.decode_width == width
        assert p.decode_tables().tolist() == rebuilt(dec_tables, width).tolist()
    assert [(pf.q_start, pf.q_len, pf.context_len, list(pf.block_table)) for pf in p.prefills] == prefills
    if prefills:
        width = max(len(t) for *_, t in prefills)
        assert p.prefill_tables().tolist() == rebuilt([t for *_, t in prefills], width).tolist()


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_seqs=6, max_num_batched_tokens=40, num_kv_blocks=30),  # preemption
        dict(max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=False),
        dict(max_num_seqs=3, max_num_batched_tokens=512),  # sweeps: many more sequences than rows
    ],
)
def test_every_packed_step_equals_a_rebuild(tiny_model_dir, kw):
    from batchery.engine.config import EngineConfig
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model

    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=4, attention_backend="auto", **kw)
    eng = LLMEngine(config, loaded=load_model(config))
    runner = eng.runner
    pack = runner.pack
    steps = []

    def checked(seqs, num_new_tokens):
        p = pack(seqs, num_new_tokens)
        check_pack(runner, seqs, num_new_tokens, p)
        steps.append((p.num_decode, len(p.prefills)))
        return p

    runner.pack = checked
    rng = random.Random(3)
    shared = [rng.randrange(6, 180) for _ in range(10)]
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(6, 180) for _ in range(rng.randrange(1, 25))]
        eng.add_request(
            str(i),
            prompt,
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True, n=2 if i % 7 == 3 else 1),
        )
    n = 0
    while eng.has_unfinished():
        eng.step()
        n += 1
        if n == 5:
            eng.abort("4")
    assert any(d and not f for d, f in steps) and any(d and f for d, f in steps)  # decode-only and mixed steps
    if "num_kv_blocks" in kw:
        assert eng.scheduler.num_preemptions > 0
    assert runner.batch.num_tail_writes > 0


def test_to_device_keeps_dtypes_and_shapes():
    """The one-copy upload keeps each array's dtype and shape (int32 tables beside int64 ids)."""
    from batchery.engine.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    a, b, c = runner._to_device([[1, 2], np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros(0, dtype=np.int64)])
    assert (a.dtype, b.dtype, c.dtype) == (torch.int64, torch.int32, torch.int64)
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]] and a.tolist() == [1, 2] and c.numel() == 0


def test_one_copy_byte_packing_round_trips():
    """What the CUDA path sends in one copy (``pack_arrays``) and views on the device
    (``unpack_segments``), here with a CPU tensor standing in for the device copy: int64 and int32
    arrays, 2-D, empty and odd-sized ones come back equal, each at an 8-byte aligned offset."""
    from batchery.engine.packed_step import pack_arrays, packed_nbytes, unpack_segments

    arrays = [
        np.array([5, -1, 2**40], dtype=np.int64),
        np.arange(7, dtype=np.int32),  # 28 bytes: the next one starts at a padded offset
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.zeros(0, dtype=np.int64),
        np.arange(6, dtype=np.int64).reshape(1, 6),
        np.arange(10, dtype=np.int64)[::2],  # not contiguous
    ]
    buf, segments = pack_arrays(arrays)
    assert len(buf) == packed_nbytes(arrays) == 24 + 32 + 48 + 0 + 48 + 40
    assert all(off % 8 == 0 for off, *_ in segments)
    out = unpack_segments(torch.from_numpy(buf.copy()), segments)
    for a, t in zip(arrays, out, strict=True):
        assert t.dtype == {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}[a.dtype]
        assert tuple(t.shape) == a.shape and t.tolist() == a.tolist()
