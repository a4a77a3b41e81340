"""Iteration-level scheduler: token budget, decode first, chunked prefill, preemption by recompute,
isolated sequences (quarantine) that run only in steps of their own, and the choices of one request
(``SamplingParams.n``) forked from its first choice once that has computed the prompt.

Requests that share a prefix (a document, a system prompt) compute it once: a waiting request whose next
uncached full prompt block (by the prefix cache's hash chain) a running sequence is computing right now is
held back, without holding up those behind it, until that block is in the prefix cache; then it hits it.

Pure Python: plain ints, no torch."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from batchery.engine.block_manager import BlockManager
from batchery.engine.outputs import ModelRunnerOutput, TokenLogprobs
from batchery.engine.sequence import Sequence, SequenceStatus
from batchery.engine.stop_checker import StopCheck

# The most steps a waiting sequence is held back, in all, for a prefix block a running one is computing. A holder
# computes its prefill chunk every step it runs, so the hold normally ends within ceil(prefix / chunk) steps;
# the bound only keeps a holder that stalls (starved of budget, preempted and readmitted) from starving it.
MAX_PREFIX_WAIT_STEPS = 256


@dataclass
class SchedulerOutput:
    """One step's work, handed to the model runner and back to ``update_from_output``."""

    seqs: list[Sequence] = field(default_factory=list)  # the sequences computed this step, in admission order
    num_new_tokens: list[int] = field(default_factory=list)  # per seq, tokens computed this step
    num_preempted: int = 0  # running sequences preempted while scheduling it
    isolated: bool = False  # the step is one isolated sequence, alone (``Sequence.isolated``)

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
        self.isolated: list[Sequence] = []  # the isolated ones among waiting, forked and running, in arrival order
        self.last_step_isolated = False  # whose turn is next while both kinds have work
        self.num_preemptions = 0
        # Choices 1..n-1 of a request wait here, under its choice 0 (the parent), until the parent has
        # computed the prompt; then each forks the parent's full prompt blocks (``BlockManager.fork``).
        self.unforked: dict[Sequence, list[Sequence]] = {}
        # Forked choices holding their share of the prompt blocks, not yet admitted. They go in before
        # anything waiting (their request is already running), and one that does not fit gives its
        # blocks back and waits like a new sequence: no queued sequence holds blocks others need.
        self.forked: list[Sequence] = []
        self.num_forks = 0  # choices that forked a parent's prompt blocks
        self.num_prompt_tokens_computed = 0  # prompt positions run through the model (recomputation included)
        self.num_prefix_waits = 0  # steps waiting sequences were held back for a prefix being computed
        # Async scheduling (``advance`` / ``commit``): the sequences of the step queued on the device
        # and not yet committed, whose blocks a finish must not free until it has run (``deferred``,
        # freed by the next ``commit``); and those whose placeholder is certainly their last token (a
        # length limit), which no step schedules again (their next token would be thrown away).
        self.held: set[Sequence] = set()
        self.deferred: list[Sequence] = []
        self.finishing: set[Sequence] = set()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        key = seq.sort_key()
        if not self.waiting or self.waiting[-1].sort_key() <= key:
            self.waiting.append(seq)  # the common case: arrivals in order
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, key, key=Sequence.sort_key), seq)
        if seq.isolated and seq not in self.isolated:
            self.isolated.append(seq)

    def add_fork(self, child: Sequence, parent: Sequence) -> None:
        """Queue ``child``, another choice of ``parent``'s request (same prompt), to start from the
        parent's prompt blocks: it waits until the step in which the parent samples its first token
        (the prompt is computed then), forks the parent's full prompt blocks and recomputes only the
        tail of the prompt. A parent that has sampled already, or is not here, cannot be forked:
        the child is queued on its own then."""
        if child.num_prompt_tokens != parent.num_prompt_tokens or child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError("add_fork: a child must have its parent's prompt")
        known = parent in self.running or parent in self.waiting or parent in self.unforked
        if not known or parent.num_output_tokens:
            self.add(child)
            return
        child.status = SequenceStatus.WAITING
        self.unforked.setdefault(parent, []).append(child)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: waiting, forked and not yet admitted, or waiting for their fork."""
        return len(self.waiting) + len(self.forked) + sum(map(len, self.unforked.values()))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.forked or self.unforked)

    def remove(self, seq: Sequence, free: bool = True) -> None:
        """Drop a sequence (finished or aborted) and release its blocks (unless not ``free``). Choices
        still waiting to fork from it start on their own instead (queued by their own sort key)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.forked:
            self.forked.remove(seq)
        else:
            for parent, children in list(self.unforked.items()):
                if seq in children:
                    children.remove(seq)
                    if not children:
                        del self.unforked[parent]
                    break
        if seq.isolated and seq in self.isolated:
            self.isolated.remove(seq)
        for child in self.unforked.pop(seq, []):
            self.add(child)
        if free:
            self.block_manager.free_seq(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (it stopped, or was aborted): drop it and release its blocks. Under
        async scheduling a sequence of the step still on the device keeps its blocks until that
        step is committed (the step writes their K/V): they are ``deferred``."""
        held = seq in self.held
        self.remove(seq, free=not held)
        if held:
            self.deferred.append(seq)
        if self.finishing:
            self.finishing.discard(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- async scheduling ------------------------------------------------------------------
    # The engine launches step k, commits step k-1 (its tokens are read now, one step late), then
    # advances k; then it schedules k+1 while k runs. A sequence that samples in k gets a placeholder
    # token ``-1 - j`` (j: its row among k's sampled rows), so that k+1 schedules one more token for
    # it as if the token were known; the model runner takes that input id on the device from k's
    # sampled ids. k-1's commit writes the real tokens over the placeholders before k is advanced,
    # so every token that ``advance`` counts as computed (and publishes in a full block) is real.

    def advance(self, out: SchedulerOutput, sampled: list[Sequence], max_model_len: int) -> None:
        """After step ``out`` was launched (and the step before it committed): count its tokens as
        computed and publish the blocks it fills, as ``update_from_output`` does, and give each of
        ``sampled`` (the sequences it samples for, in row order) its placeholder token. A sequence
        that finished meanwhile (the previous step's tokens stopped it, or it was aborted) is left
        alone: this step computes its row for nothing, and its token is never read. One whose
        placeholder reaches its length limit goes to ``finishing``."""
        finished = SequenceStatus.FINISHED
        self._count_computed(out, skip_finished=True)
        for j, seq in enumerate(sampled):
            if seq.status is finished:
                continue
            ids = seq.token_ids
            ids.append(-1 - j)
            num_tokens = len(ids)
            if num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= max_model_len:
                self.finishing.add(seq)

    def commit(self, runner_out: ModelRunnerOutput, check_stop: StopCheck) -> list[Sequence]:
        """The tokens of the step launched before the last one, now on the host: first the blocks
        of sequences that finished while it ran are freed (``deferred``: it has run), then each
        token replaces its sequence's placeholder (the last of its tokens), and the rest is as in
        ``update_from_output``: logprobs, the stop check, forks, finishes (deferred for the
        sequences of the step still running). Tokens of sequences that finished meanwhile (aborted)
        are dropped. Returns the sequences that finished, in sampling order."""
        if self.deferred:
            self.release_deferred()
        finished: list[tuple[Sequence, str]] = []
        done = SequenceStatus.FINISHED
        for seq, tok, entry in zip(runner_out.sampled_seqs, runner_out.token_ids, runner_out.logprobs, strict=True):
            if seq.status is done:
                continue
            ids = seq.token_ids
            assert ids[-1] < 0, "a committed token replaces its sequence's placeholder"
            ids[-1] = tok
            reason = self._took(seq, tok, entry, check_stop)
            if reason is not None:
                finished.append((seq, reason))
        self._fork_children(runner_out.sampled_seqs, skip_finished=True)
        for seq, reason in finished:
            self.finish(seq, reason)
        return [seq for seq, _ in finished]

    def release_deferred(self) -> None:
        """Free the blocks of finished sequences that waited for a step to run (it has)."""
        for seq in self.deferred:
            self.block_manager.free_seq(seq)
        self.deferred = []

    def update_from_output(
        self, out: SchedulerOutput, runner_out: ModelRunnerOutput, check_stop: StopCheck
    ) -> list[Sequence]:
        """After the step ``out`` ran: count its tokens as computed, append each sampled token (and
        its logprobs), publish newly full blocks to the prefix cache, and finish the sequences
        ``check_stop`` says are done. Returns those, in sampling order."""
        self._count_computed(out, skip_finished=False)
        finished: list[tuple[Sequence, str]] = []
        for seq, tok, entry in zip(runner_out.sampled_seqs, runner_out.token_ids, runner_out.logprobs, strict=True):
            seq.token_ids.append(tok)
            reason = self._took(seq, tok, entry, check_stop)
            if reason is not None:
                finished.append((seq, reason))
        # A parent that sampled its first token has just computed its prompt: its choices fork now,
        # before a parent that finished in this same step gives its blocks back.
        self._fork_children(runner_out.sampled_seqs, skip_finished=False)
        for seq, reason in finished:
            self.finish(seq, reason)
        return [seq for seq, _ in finished]

    @staticmethod
    def _took(seq: Sequence, tok: int, entry: TokenLogprobs | None, check_stop: StopCheck) -> str | None:
        """A sampled token now in ``seq.token_ids``: its grammar and logprobs follow it; the stop check's verdict."""
        if seq.grammar is not None:
            seq.grammar.accept(tok)  # the sampler masked the logits by it, so the token is allowed
        if entry is not None:
            assert seq.logprobs is not None  # the sampler gives entries only to requests that ask for them
            seq.logprobs.append(entry)
        return check_stop(seq, tok)

    def _count_computed(self, out: SchedulerOutput, *, skip_finished: bool) -> None:
        """Count step ``out``'s tokens as computed and publish the blocks it filled to the prefix
        cache (``update_from_output`` and, launched ahead, ``advance``; the latter skips sequences
        that finished meanwhile: their row is computed for nothing)."""
        bm = self.block_manager
        bs = bm.block_size
        caching = bm.enable_prefix_caching
        finished = SequenceStatus.FINISHED
        prompt_computed = 0
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if skip_finished and seq.status is finished:
                continue
            # the chunk covers positions [computed, computed + n); those before the prompt's end are prompt
            left = seq.num_prompt_tokens - seq.num_computed_tokens
            if left > 0:
                prompt_computed += n if n < left else left
            seq.num_computed_tokens += n
            # publish the blocks this step filled (a decode sequence fills one every block_size steps): the tokens
            # they hold are all computed, so this is the same before the sampled token is appended as after
            if caching and seq.num_computed_tokens // bs > len(seq.block_hashes):
                bm.register_full_blocks(seq)
        self.num_prompt_tokens_computed += prompt_computed

    def _fork_children(self, sampled: list[Sequence], *, skip_finished: bool) -> None:
        """Fork the waiting choices (``n`` > 1) of each parent among ``sampled`` that has them: it
        sampled its first token, so its prompt is computed and its blocks can be shared."""
        if not self.unforked:
            return
        finished = SequenceStatus.FINISHED
        for seq in sampled:
            if skip_finished and seq.status is finished:
                continue
            for child in self.unforked.pop(seq, []):
                self.block_manager.fork(seq, child)
                self.forked.append(child)
                if child.isolated:
                    self.isolated.append(child)
                self.num_forks += 1

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
        """The next step. An isolated sequence never shares a step: a step is either one isolated
        sequence alone or only the others, and while both have work they take turns (so neither
        waits for the other to finish). If the kind whose turn it is cannot run (no blocks, no
        slot), the other kind runs instead."""
        if not self.isolated:
            self.last_step_isolated = False
            return self._schedule_batch()
        has_others = len(self.running) + len(self.waiting) + len(self.forked) > len(self.isolated)
        kinds = (False, True) if has_others and self.last_step_isolated else (True, False)
        num_preempted = 0
        for isolated in kinds:
            out = self._schedule_isolated() if isolated else self._schedule_batch()
            out.num_preempted += num_preempted
            if out:
                self.last_step_isolated = isolated
                return out
            num_preempted = out.num_preempted
        return out  # nothing fits this step (it may have preempted something to make room)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move waiting (or forked) ``seq`` to running with a first chunk of at most ``budget``
        tokens; returns the chunk's size, or 0 if its blocks do not fit. Then a waiting sequence is
        left as it was; a forked one gives its shared blocks back and queues as a waiting sequence
        (it recomputes its prompt, from the prefix cache where it can)."""
        bm = self.block_manager
        forked = seq in self.forked
        if not forked:
            bm.match_prefix(seq)
        n = min(seq.num_uncomputed_tokens, budget)
        if not bm.can_allocate(seq, n):
            bm.free_seq(seq)  # give back prefix-cache references taken by match_prefix, or the fork's
            if forked:
                self.forked.remove(seq)
                self.add(seq)
            return 0
        bm.allocate(seq, n)
        if forked:
            self.forked.remove(seq)
        else:
            self.waiting.remove(seq)
            if bm.enable_prefix_caching:
                bm.num_query_tokens += seq.num_tokens
                bm.num_hit_tokens += seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _schedule_isolated(self) -> SchedulerOutput:
        """A step of one isolated sequence alone: a running one's next token or prefill chunk, else
        the admission of a forked one or of the first waiting one. Others are preempted if its
        blocks do not fit, as in a shared step."""
        bm = self.block_manager
        out = SchedulerOutput(isolated=True)
        running = [s for s in self.isolated if s.status == SequenceStatus.RUNNING]
        budget = self.max_num_batched_tokens
        if running:
            seq = running[0]
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = self._preemption_victim()
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    return out
            bm.allocate(seq, n)
        else:
            # a forked choice goes first, as in a shared step: it holds blocks until it runs
            forked = [s for s in self.forked if s.isolated]
            seq = forked[0] if forked else min(self.isolated, key=Sequence.sort_key)
            if len(self.running) >= self.max_num_seqs:
                return out
            n = self._admit(seq, budget)
            if not n:
                return out
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        return out

    def _schedule_batch(self) -> SchedulerOutput:
        """A step of the sequences that are not isolated."""
        bm = self.block_manager
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences: one decode token each, or the next chunk of an unfinished prefill.
        cands = [s for s in self.running if not s.isolated] if self.isolated else list(self.running)
        if self.finishing:  # async scheduling: their next token would be thrown away
            cands = [s for s in cands if s not in self.finishing]
        bs = bm.block_size
        i = 0
        while i < len(cands) and budget > 0:
            seq = cands[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if seq.num_computed_tokens + n <= len(seq.block_table) * bs:
                # its table covers the step already (a decode token inside its last block, most steps): nothing
                # to allocate, so nothing to preempt for; the same as the path below with blocks_needed == 0
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            while not bm.can_allocate(seq, n):
                # Out of blocks: preempt the lowest-priority, newest running sequence, even one
                # already scheduled this step (it is taken back out of the step).
                victim = self._preemption_victim()
                if victim in cands:
                    j = cands.index(victim)
                    if j < i:
                        k = out.seqs.index(victim)
                        budget += out.num_new_tokens.pop(k)
                        out.seqs.pop(k)
                        i -= 1
                    cands.pop(j)
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

        # 2. Forked choices (their request is running already), then waiting sequences in
        # priority/FCFS order, while budget, slots and blocks allow. An isolated one first in line
        # stops the line: it goes in on its own turn, and no one behind it takes its slot or its
        # blocks meanwhile.
        # A waiting sequence whose next uncached prompt block a running one is computing right now is
        # held back (skipped, not blocking those behind it) until that block is in the prefix cache.
        if out.num_preempted:
            return out
        inflight: set[int] | None = None  # prompt blocks running sequences are computing (built on first need)
        num_held = 0  # held-back sequences at the head of the waiting line, skipped this step
        while budget > 0 and len(self.running) < self.max_num_seqs:
            forked = [s for s in self.forked if not s.isolated]
            if forked:
                seq = forked[0]
            elif num_held < len(self.waiting) and not self.waiting[num_held].isolated:
                seq = self.waiting[num_held]
                if bm.enable_prefix_caching:
                    if inflight is None:
                        inflight = {h for r in self.running for h in bm.pending_prompt_hashes(r)}
                    if self._hold(seq, inflight):
                        num_held += 1
                        continue
            else:
                break
            n = self._admit(seq, budget)
            if not n:
                break
            if inflight is not None:
                inflight.update(bm.pending_prompt_hashes(seq))
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _hold(self, seq: Sequence, inflight: set[int]) -> bool:
        """Whether waiting ``seq`` waits this step for a prefix block a running sequence is computing (it
        would compute the same block itself otherwise); counted, and never for more than
        ``MAX_PREFIX_WAIT_STEPS`` steps in all, so a holder that stalls cannot starve it."""
        if not inflight or seq.num_prefix_waits >= MAX_PREFIX_WAIT_STEPS:
            return False
        h = self.block_manager.first_uncached_block(seq)
        if h is None or h not in inflight:
            return False
        seq.num_prefix_waits += 1
        self.num_prefix_waits += 1
        return True
