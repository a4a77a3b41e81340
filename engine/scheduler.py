"""Iteration-level scheduler: token budget, decode first, chunked prefill, preemption by recompute.

Pure Python: plain ints, no torch."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from batchery.engine.block_manager import BlockManager
from batchery.engine.outputs import ModelRunnerOutput
from batchery.engine.sequence import Sequence, SequenceStatus
from batchery.engine.stop_checker import StopCheck


@dataclass
class SchedulerOutput:
    """One step's work, handed to the model runner and back to ``update_from_output``."""

    seqs: list[Sequence] = field(default_factory=list)  # the sequences computed this step, in admission order
    num_new_tokens: list[int] = field(default_factory=list)  # per seq, tokens computed this step
    num_preempted: int = 0  # running sequences preempted while scheduling it

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_time)
        self.running: list[Sequence] = []  # admission order; decode tokens go first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.sort_key()), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (it stopped, or was aborted): drop it and release its blocks."""
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def update_from_output(
        self, out: SchedulerOutput, runner_out: ModelRunnerOutput, check_stop: StopCheck
    ) -> list[Sequence]:
        """After the step ``out`` ran: count its tokens as computed, append each sampled token (and
        its logprobs), publish newly full blocks to the prefix cache, and finish the sequences
        ``check_stop`` says are done. Returns those, in sampling order."""
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        finished: list[tuple[Sequence, str]] = []
        for seq, tok, entry in zip(runner_out.sampled_seqs, runner_out.token_ids, runner_out.logprobs, strict=True):
            seq.token_ids.append(tok)
            if entry is not None:
                assert seq.logprobs is not None  # the sampler gives entries only to requests that ask for them
                seq.logprobs.append(entry)
            reason = check_stop(seq, tok)
            if reason is not None:
                finished.append((seq, reason))
        bm = self.block_manager
        for seq in out.seqs:
            bm.register_full_blocks(seq)
        for seq, reason in finished:
            self.finish(seq, reason)
        return [seq for seq, _ in finished]

    def set_step_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Change the per-step limits (the engine halves them after an out-of-memory step and
        restores them later). Running sequences beyond ``max_num_seqs`` are preempted, the
        lowest-priority, newest first. Returns how many were."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        num_preempted = 0
        while len(self.running) > max_num_seqs:
            self._preempt(self._preemption_victim())
            num_preempted += 1
        return num_preempted

    def _preemption_victim(self) -> Sequence:
        """The running sequence to give up first: the lowest priority, and the newest within it."""
        return max(self.running, key=Sequence.sort_key)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences: one decode token each, or the next chunk of an unfinished prefill.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                # Out of blocks: preempt the lowest-priority, newest running sequence, even one
                # already scheduled this step (it is taken back out of the step).
                victim = self._preemption_victim()
                if self.running.index(victim) < i:
                    k = out.seqs.index(victim)
                    budget += out.num_new_tokens.pop(k)
                    out.seqs.pop(k)
                    i -= 1
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.allocate(seq, n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
            # when seq itself was preempted the list shifted, so index i now holds the next one

        # 2. Waiting sequences, in priority/FCFS order, while budget, slots and blocks allow.
        if out.num_preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, n):
                bm.free_seq(seq)  # give back prefix-cache references taken by match_prefix
                break
            bm.allocate(seq, n)
            self.waiting.pop(0)
            if bm.enable_prefix_caching:
                bm.num_query_tokens += seq.num_tokens
                bm.num_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out
