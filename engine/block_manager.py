"""Paged KV-cache block pool with reference counts and prefix caching.

Full blocks are identified by a chained hash (parent hash + the block's token ids), so a shared
prefix (system prompt, chat template) maps to the same physical blocks. Blocks whose reference
count drops to zero keep their hash and sit in an LRU of evictable blocks until reused.

Pure Python: plain ints, no torch."""

from __future__ import annotations

from collections import OrderedDict

from batchery.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # free blocks in eviction order: never-cached first, then least-recently freed cached ones
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_hit_tokens = 0
        self.num_query_tokens = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers ``num_computed_tokens + num_new_tokens`` tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def can_append(self, seq: Sequence) -> bool:
        return self.can_allocate(seq, 1)

    # -- prefix cache ----------------------------------------------------------------------
    def prompt_hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of ``seq``'s full prompt blocks (computed once: the prompt never changes)."""
        if seq.prompt_hashes is None:
            bs = self.block_size
            hashes: list[int] = []
            parent = None
            for i in range(seq.num_prompt_tokens // bs):
                parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
                hashes.append(parent)
            seq.prompt_hashes = hashes
        return seq.prompt_hashes

    def first_uncached_block(self, seq: Sequence) -> int | None:
        """The hash of the first prompt block ``match_prefix`` would not find in the prefix cache, among
        those it looks up (every full block before the last token); None when it would find them all."""
        if not self.enable_prefix_caching:
            return None
        hashes = self.prompt_hashes(seq)
        for h in hashes[: (seq.num_tokens - 1) // self.block_size]:
            if h not in self.hash_to_block:
                return h
        return None

    def pending_prompt_hashes(self, seq: Sequence) -> list[int]:
        """The hashes of the full prompt blocks a running ``seq`` has yet to compute and publish."""
        if not self.enable_prefix_caching or seq.num_computed_tokens >= seq.num_prompt_tokens:
            return []
        return self.prompt_hashes(seq)[len(seq.block_hashes) :]

    def match_prefix(self, seq: Sequence) -> None:
        """On first schedule: attach cached full blocks of the prompt, set the computed counters.

        At least the last token is always recomputed, so the step has a token to sample from."""
        if seq.block_table:
            return
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        parent = None
        if self.enable_prefix_caching:
            for i in range(max_blocks):
                h = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
                block = self.hash_to_block.get(h)
                if block is None:
                    break
                self._take(block)
                seq.block_table.append(block)
                seq.block_hashes.append(h)
                parent = h
        hits = len(seq.block_hashes)
        seq.num_computed_tokens = hits * bs
        seq.num_cached_tokens = hits * bs

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: publish newly computed full blocks under their chained hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i > 0 else None
            h = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            block = seq.block_table[i]
            # When the same content was computed twice at once, the first copy stays published and
            # this block stays anonymous; the chain still continues from ``h``.
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
            seq.block_hashes.append(h)

    # -- allocation ------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict the cached content it held
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover the tokens scheduled this step. Caller checked can_allocate."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._pop_free())

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Share ``parent``'s full prompt blocks with ``child`` (another choice of the same request,
        not yet scheduled), one more reference each; returns how many. Only blocks that hold prompt
        tokens before the last one are shared, ``(P - 1) // block_size`` for a P-token prompt: no
        sequence writes into them any more (the parent's new tokens go after the prompt), and the
        child recomputes the rest, at least the last prompt token, so that it samples its own first
        token. The caller makes sure the parent has computed its prompt."""
        if child.block_table:
            raise ValueError("fork: the child already has blocks")
        bs = self.block_size
        n = min((child.num_prompt_tokens - 1) // bs, parent.num_computed_tokens // bs, len(parent.block_table))
        for block in parent.block_table[:n]:
            self._take(block)
        child.block_table = parent.block_table[:n]
        child.block_hashes = parent.block_hashes[:n]  # the chain continues past them (prefix caching)
        child.num_computed_tokens = n * bs
        child.num_cached_tokens = 0  # shared within the request, not served from the prefix cache
        return n

    def free_seq(self, seq: Sequence) -> None:
        """Release a sequence's blocks (finish, abort or preemption). Cached ones stay reusable."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # anonymous blocks are reused first
                else:
                    self.free[block] = None  # most recently freed cached block is evicted last
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
