"""Unit tests of the paged KV block pool: allocation, reference counts, prefix-hash reuse, LRU
eviction of free cached blocks, and the can_allocate / can_append answers.

Pure Python: nothing here imports torch (checked in a subprocess, since a shared pytest session
may already have imported it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchery.engine.block_manager import BlockManager, hash_block
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
BS = 4  # block size used throughout


def make_seq(tokens, rid: str = "s", **kw) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), **kw)


def compute(bm: BlockManager, seq: Sequence, n: int | None = None, next_token: int = 999) -> None:
    """What one engine step does for ``seq``: allocate, mark ``n`` tokens computed, append a sampled
    token when the whole sequence is computed, then publish newly full blocks."""
    if not seq.block_table:
        bm.match_prefix(seq)
    n = seq.num_uncomputed_tokens if n is None else n
    assert bm.can_allocate(seq, n)
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    if seq.num_computed_tokens == seq.num_tokens:
        seq.token_ids.append(next_token)
    bm.register_full_blocks(seq)


def assert_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    """Reference counts equal the number of block-table entries; free list == blocks with ref 0."""
    counts = [0] * bm.num_blocks
    for s in live:
        for b in s.block_table:
            counts[b] += 1
    assert bm.ref_counts == counts
    assert set(bm.free) == {b for b in range(bm.num_blocks) if counts[b] == 0}
    assert bm.num_free_blocks == len(bm.free)
    for h, b in bm.hash_to_block.items():
        assert bm.block_hash[b] == h


def cached_blocks(bm: BlockManager, tokens) -> int:
    """Leading full blocks of ``tokens`` present in the prefix cache (no side effects on the LRU)."""
    parent, n = None, 0
    for i in range(len(tokens) // bm.block_size):
        parent = hash_block(parent, tokens[i * bm.block_size : (i + 1) * bm.block_size])
        if parent not in bm.hash_to_block:
            break
        n += 1
    return n


def probe_hits(bm: BlockManager, tokens) -> int:
    """Cached tokens a new sequence with ``tokens`` would get; its references are given back."""
    s = make_seq(tokens, "probe")
    bm.match_prefix(s)
    hits = s.num_cached_tokens
    bm.free_seq(s)
    return hits


def test_pure_python_modules_do_not_import_torch():
    code = (
        "import sys, batchery.engine.scheduler, batchery.engine.block_manager, batchery.engine.sequence, "
        "batchery.engine.sampling, batchery.engine.outputs, batchery.engine.stop_checker; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_rejects_empty_pool_or_block_size():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# -- allocation, free, reference counts --------------------------------------------------------


def test_allocate_grows_table_to_cover_tokens_and_free_returns_blocks():
    bm = BlockManager(8, BS)
    s = make_seq(range(10, 20))  # 10 tokens -> 3 blocks
    assert bm.blocks_needed(s, 10) == 3
    assert bm.blocks_needed(s, 4) == 1
    bm.allocate(s, 6)  # a chunk of 6 tokens needs 2 blocks
    assert len(s.block_table) == 2 and len(set(s.block_table)) == 2
    assert bm.num_free_blocks == 6
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    s.num_computed_tokens = 6
    assert bm.blocks_needed(s, 2) == 0  # 8 tokens still fit in 2 blocks
    assert bm.blocks_needed(s, 4) == 1
    bm.allocate(s, 4)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert_consistent(bm, [s])

    bm.free_seq(s)
    assert s.block_table == [] and s.num_computed_tokens == 0 and s.num_hashed_blocks == 0
    assert bm.num_free_blocks == 8 and bm.ref_counts == [0] * 8
    assert_consistent(bm, [])


def test_two_sequences_get_distinct_blocks():
    bm = BlockManager(8, BS)
    a, b = make_seq(range(100, 106), "a"), make_seq(range(200, 206), "b")
    compute(bm, a)
    compute(bm, b)
    assert not set(a.block_table) & set(b.block_table)
    assert_consistent(bm, [a, b])
    assert bm.num_free_blocks == 4


# -- prefix caching ----------------------------------------------------------------------------


def test_shared_prefix_reuses_full_blocks_with_ref_count_two():
    bm = BlockManager(16, BS)
    common = list(range(10, 18))  # two full blocks
    a = make_seq(common + [30, 31], "a")
    compute(bm, a)
    assert a.num_cached_tokens == 0 and a.num_hashed_blocks == 2  # the partial 3rd block is not hashed

    b = make_seq(common + [40, 41, 42], "b")
    bm.match_prefix(b)
    assert b.block_table == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    compute(bm, b)
    assert b.block_table[2] != a.block_table[2]  # the partial last block is never shared
    assert_consistent(bm, [a, b])

    # freeing one sharer keeps the shared blocks allocated for the other
    bm.free_seq(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    assert not set(b.block_table) & set(bm.free)
    assert_consistent(bm, [b])
    bm.free_seq(b)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16


def test_partial_last_block_is_never_shared_even_for_identical_prompts():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    a = make_seq(prompt, "a")
    compute(bm, a, next_token=50)
    b = make_seq(prompt, "b")
    bm.match_prefix(b)
    assert b.num_cached_tokens == 8
    assert b.num_uncomputed_tokens == 2  # the tail is recomputed
    compute(bm, b, next_token=60)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[a.block_table[2]] == 1 and bm.ref_counts[b.block_table[2]] == 1


def test_whole_prompt_cached_still_leaves_a_token_to_compute():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 18))  # exactly two full blocks
    a = make_seq(prompt, "a")
    compute(bm, a)
    assert a.num_hashed_blocks == 2

    b = make_seq(prompt, "b")
    bm.match_prefix(b)
    assert b.num_uncomputed_tokens >= 1
    assert b.num_cached_tokens == 4  # the last block holds the last prompt token: recomputed
    assert b.block_table == a.block_table[:1]

    one = make_seq(prompt[:4], "one")  # a one-block prompt: nothing can be reused
    bm.match_prefix(one)
    assert one.num_cached_tokens == 0 and one.block_table == []

    c = make_seq(prompt + [77], "c")  # 9 tokens: both blocks reused, one token left
    bm.match_prefix(c)
    assert c.num_cached_tokens == 8 and c.num_uncomputed_tokens == 1


def test_prefix_hash_is_chained_on_position():
    """A block is reused only after the same preceding blocks, never for equal content elsewhere."""
    bm = BlockManager(16, BS)
    x, y = [20, 21, 22, 23], [30, 31, 32, 33]
    a = make_seq(x + y + [1], "a")
    compute(bm, a)
    assert probe_hits(bm, y + [1, 2, 3, 4, 5]) == 0  # y's block follows x in a
    assert probe_hits(bm, x + [1, 2, 3, 4, 5]) == 4
    assert probe_hits(bm, x + y + [9]) == 8
    assert hash_block(None, y) != hash_block(hash_block(None, x), y)
    assert_consistent(bm, [a])


def test_prefix_caching_disabled_shares_nothing():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(10, 19))
    a = make_seq(prompt, "a")
    compute(bm, a)
    assert bm.hash_to_block == {} and a.num_hashed_blocks == 0
    b = make_seq(prompt, "b")
    bm.match_prefix(b)
    assert b.num_cached_tokens == 0 and b.block_table == []
    compute(bm, b)
    assert not set(a.block_table) & set(b.block_table)


def test_cached_blocks_of_a_finished_sequence_are_reused_after_it_is_freed():
    bm = BlockManager(8, BS)
    prompt = list(range(10, 19))
    a = make_seq(prompt, "a")
    compute(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    assert bm.num_free_blocks == 8  # cached blocks count as free

    b = make_seq(prompt, "b")
    bm.match_prefix(b)
    assert b.block_table == table[:2] and b.num_cached_tokens == 8
    assert bm.num_free_blocks == 6  # taking a cached block removes it from the free list
    assert_consistent(bm, [b])


def test_duplicate_content_computed_concurrently_keeps_one_copy_in_the_cache():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 19))
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    for s in (a, b):  # both scheduled in the same step: no hits yet
        bm.match_prefix(s)
        assert s.num_cached_tokens == 0
        bm.allocate(s, len(prompt))
    for s in (a, b):  # the step ran: register in schedule order
        s.num_computed_tokens = len(prompt)
        s.token_ids.append(99)
        bm.register_full_blocks(s)
    assert a.num_hashed_blocks == b.num_hashed_blocks == 2
    assert set(bm.hash_to_block.values()) <= set(a.block_table)
    assert all(bm.block_hash[x] is None for x in b.block_table)
    assert_consistent(bm, [a, b])
    # a later sequence reuses a's copy
    assert probe_hits(bm, prompt) == 8


def test_blocks_after_a_duplicate_block_keep_their_chained_hash():
    bm = BlockManager(16, BS)
    prompt = list(range(10, 18))  # exactly two blocks
    a = make_seq(prompt, "a")
    compute(bm, a, next_token=99)
    bm.free_seq(a)

    b = make_seq(prompt, "b")  # reuses block 0, recomputes block 1 (already cached by a: stays anonymous)
    compute(bm, b, next_token=50)
    assert b.num_cached_tokens == 4
    for tok in (51, 52, 53, 54):  # decode until block 2 (tokens 50..53) is full and registered
        compute(bm, b, n=1, next_token=tok)
    assert b.num_hashed_blocks == 3
    # A brand-new prompt that merely starts with b's generated tokens must not hit anything:
    # those K/V belong to positions 8..11 after `prompt`, not to positions 0..3.
    assert probe_hits(bm, [50, 51, 52, 53, 7]) == 0
    # ...while the real continuation of the chain is found
    assert probe_hits(bm, prompt + [50, 51, 52, 53, 7]) == 12


# -- LRU eviction ------------------------------------------------------------------------------


def test_least_recently_freed_cached_block_is_evicted_first():
    bm = BlockManager(4, BS)
    pa, pb = list(range(10, 18)), list(range(20, 28))
    a = make_seq(pa, "a")
    compute(bm, a)  # 8 prompt tokens: 2 full blocks, both cached
    ta = list(a.block_table)
    assert len(ta) == 2 and a.num_hashed_blocks == 2
    bm.free_seq(a)
    b = make_seq(pb, "b")
    compute(bm, b)
    tb = list(b.block_table)
    bm.free_seq(b)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 4  # everything free, everything cached
    assert cached_blocks(bm, pa) == 2 and cached_blocks(bm, pb) == 2

    c = make_seq(range(40, 43), "c")  # new content, one block: a's tail block (freed first) goes
    compute(bm, c)
    assert c.block_table == [ta[1]]
    assert cached_blocks(bm, pa) == 1  # a lost its tail block only
    assert cached_blocks(bm, pb) == 2  # b (freed later) is intact
    bm.free_seq(c)  # c's block is anonymous: reused before any cached block

    d = make_seq(range(50, 57), "d")  # two blocks: c's anonymous block, then a's head block
    compute(bm, d)
    assert sorted(d.block_table) == sorted([ta[1], ta[0]])
    assert cached_blocks(bm, pa) == 0
    assert cached_blocks(bm, pb) == 2
    assert not set(d.block_table) & set(tb)
    assert_consistent(bm, [d])


def test_lru_order_follows_free_time_not_allocation_time():
    bm = BlockManager(4, BS)
    pa, pb = list(range(10, 18)), list(range(20, 28))
    a, b = make_seq(pa, "a"), make_seq(pb, "b")
    compute(bm, a)
    compute(bm, b)
    bm.free_seq(b)  # b freed first although allocated later
    bm.free_seq(a)
    e = make_seq(range(60, 67), "e")  # needs 2 blocks: both of b's
    compute(bm, e)
    assert probe_hits(bm, pa + [1]) == 8
    assert probe_hits(bm, pb + [1]) == 0


def test_reusing_a_cached_block_refreshes_its_lru_position():
    bm = BlockManager(4, BS)
    pa, pb = list(range(10, 18)), list(range(20, 28))
    a = make_seq(pa, "a")
    compute(bm, a)
    bm.free_seq(a)
    b = make_seq(pb, "b")
    compute(bm, b)
    bm.free_seq(b)
    a2 = make_seq(pa + [1], "a2")  # touches a's blocks again: they become the most recently freed
    bm.match_prefix(a2)
    assert a2.num_cached_tokens == 8
    bm.free_seq(a2)
    e = make_seq(range(60, 67), "e")
    compute(bm, e)
    assert probe_hits(bm, pa + [1]) == 8
    assert probe_hits(bm, pb + [1]) == 0


def test_anonymous_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS)
    pa = list(range(10, 16))  # one full (cached) block + a partial (anonymous) one
    a = make_seq(pa, "a")
    compute(bm, a)
    assert a.num_hashed_blocks == 1 and len(a.block_table) == 2
    cached, anon = a.block_table
    bm.free_seq(a)
    assert bm.block_hash[cached] is not None and bm.block_hash[anon] is None

    x = make_seq(range(40, 51), "x")  # 11 tokens: 3 blocks = the 3 anonymous ones
    compute(bm, x)
    assert cached not in x.block_table and anon in x.block_table
    assert probe_hits(bm, pa[:4] + [1]) == 4  # the cached block survived
    y = make_seq(range(60, 63), "y")  # the last block: now the cached one is evicted
    compute(bm, y)
    assert y.block_table == [cached]
    assert probe_hits(bm, pa[:4] + [1]) == 0
    assert bm.hash_to_block.get(hash_block(None, pa[:4])) is None
    assert_consistent(bm, [x, y])


# -- can_allocate / can_append -----------------------------------------------------------------


def test_can_allocate_and_can_append():
    bm = BlockManager(3, BS)
    s = make_seq(range(10, 22), "s")  # 12 tokens
    assert bm.can_allocate(s, 12)  # exactly 3 blocks
    assert not bm.can_allocate(s, 13)
    compute(bm, s, n=12)  # computed 12 == num tokens: a sampled token is appended (13 tokens)
    assert bm.num_free_blocks == 0
    assert not bm.can_append(s)  # the 13th token needs a 4th block
    assert not bm.can_allocate(s, 1)
    assert bm.can_allocate(s, 0)

    t = make_seq(range(30, 33), "t")
    bm2 = BlockManager(1, BS)
    compute(bm2, t)  # 3 tokens in 1 block, 4th token sampled
    assert bm2.num_free_blocks == 0
    assert bm2.can_append(t)  # the 4th token still fits in the block
    compute(bm2, t, n=1)
    assert not bm2.can_append(t)


def test_can_allocate_counts_free_cached_blocks_as_available():
    bm = BlockManager(2, BS)
    a = make_seq(range(10, 18), "a")
    compute(bm, a)
    bm.free_seq(a)
    b = make_seq(range(20, 28), "b")
    assert bm.can_allocate(b, 8)
    compute(bm, b)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(make_seq([1], "z"), 1)
