"""The sampler as it was before issue 17 (engine/sampler.py at 0c4e299), kept as the reference the batched
sampler is compared with (tests/test_sampler_batched.py): per-row logprobs, penalties and top-k.

Original docstring: batched, vectorised sampling: logit bias, structured-output masks, penalties, temperature,
top-k, top-p, min-p, seeded generators, and top-N logprobs of the model's distribution for each
sampled token.

The order, per step: the model's log-softmax (for logprobs: they stay the model's distribution),
then ``logit_bias`` on the raw logits, then the grammar masks of the constrained rows, then
penalties, the ``min_tokens`` ban, temperature and the filters. Everything per row that the host
knows (biases, banned tokens) goes to the device as one flattened tensor and lands with one
``index_put_``; rows without a bias, a grammar or a ban cost nothing."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import Sequence, TokenLogprobs

if TYPE_CHECKING:
    from batchery.engine.structured import GrammarState

# xgrammar's BatchGrammarMatcher fills masks on a thread pool; it pays off only with many
# constrained rows and cores to spare (measured: see _fill_grammar_masks)
BATCH_FILL_MIN_ROWS = 64
BATCH_FILL_MIN_CPUS = 8


_BIT_TABLE: torch.Tensor | None = None


def _bit_table() -> torch.Tensor:
    """[256, 8] bool: the bits of each byte, lowest first (a little-endian int32 bitmask viewed as
    bytes unpacks to token order)."""
    global _BIT_TABLE
    if _BIT_TABLE is None:
        _BIT_TABLE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.bool)
    return _BIT_TABLE


class ReferenceSampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._bitmask: torch.Tensor | None = None  # reused host bitmask for the grammar rows (pinned on CUDA)
        self._batch_matcher: Any = None  # xgrammar.BatchGrammarMatcher, made on first use
        cpus = os.cpu_count() or 1
        self._batch_fill_threads = min(8, cpus // 2) if cpus >= BATCH_FILL_MIN_CPUS else 0

    def _generator_for(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.params.seed)
        return seq.generator

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_seqs, vocab]. Returns the sampled token id and logprob entry of each seq."""
        logits = logits.float()
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, params)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            self._apply_grammars(logits, seqs, constrained)

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._apply_penalties(logits, seqs)
        if any(p.min_tokens and s.num_output_tokens < p.min_tokens for s, p in zip(seqs, params, strict=True)):
            logits = self._ban_stop_tokens(logits, seqs, eos_ids)

        tokens = logits.argmax(dim=-1)  # greedy for every row; sampled rows are overwritten below
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sample_rows:
            idx = torch.tensor(sample_rows, device=logits.device)
            sub = logits[idx]
            temps = torch.tensor([params[i].temperature for i in sample_rows], device=logits.device)
            sub = sub / temps[:, None]
            sub = self._apply_top_k_top_p_min_p(sub, [params[i] for i in sample_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = torch.empty_like(probs)
            seeded = [j for j, i in enumerate(sample_rows) if params[i].seed is not None]
            unseeded = [j for j, i in enumerate(sample_rows) if params[i].seed is None]
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator
                )
            for j in seeded:
                noise[j].exponential_(generator=self._generator_for(seqs[sample_rows[j]]))
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p.
            tokens[idx] = (probs / noise).argmax(dim=-1)

        token_list = tokens.tolist()
        entries: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                tok = token_list[i]
                entry: TokenLogprobs = {"token_id": tok, "logprob": float(raw_logprobs[i, tok]), "top": []}
                if p.logprobs:
                    vals, ids = raw_logprobs[i].topk(p.logprobs)
                    entry["top"] = list(zip(ids.tolist(), vals.tolist(), strict=True))
                entries[i] = entry
        return token_list, entries

    def _apply_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Add each row's ``logit_bias`` to its raw logits: the (row, token, bias) triples of all
        rows go to the device in one tensor and are added with one ``index_put_``. Token ids
        outside the logits are skipped (the engine refuses them when the request comes in)."""
        vocab = logits.shape[1]
        rows: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            if not p.logit_bias:
                continue
            t, b = p.logit_bias_items
            if t[-1] >= vocab:  # sorted: the largest id is last
                kept = [j for j, tok in enumerate(t) if tok < vocab]
                t, b = [t[j] for j in kept], [b[j] for j in kept]
            rows.extend([i] * len(t))
            toks.extend(t)
            vals.extend(b)
        if not rows:
            return logits
        # float64 holds token ids exactly (< 2**53): one host-to-device copy for all three columns
        packed = torch.tensor(rows + toks + vals, dtype=torch.float64).view(3, -1).to(logits.device)
        logits.index_put_((packed[0].long(), packed[1].long()), packed[2].to(logits.dtype), accumulate=True)
        return logits

    def _bitmask_rows(self, num_rows: int, vocab: int) -> torch.Tensor:
        """A host int32 bitmask of at least ``num_rows`` rows for ``vocab`` tokens, reused across
        steps (only the constrained rows are written and read, so it is never cleared)."""
        import xgrammar as xgr

        words = (vocab + 31) // 32
        bm = self._bitmask
        if bm is None or bm.shape[0] < num_rows or bm.shape[1] != words:
            rows = max(num_rows, 8 if bm is None else 2 * bm.shape[0])
            bm = torch.empty((rows, words), dtype=xgr.bitmask_dtype, pin_memory=self.device.type == "cuda")
            self._bitmask = bm
        return bm

    def _fill_grammar_masks(self, bitmask: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Write row ``i`` of ``bitmask`` for each constrained row ``i``: the grammar's allowed
        tokens, narrowed by the state's ``restrict`` row (JSON: no control bytes) for all rows at
        once. One row's fill costs about 4 us on the CPU (SmolLM2's 49k vocabulary). xgrammar's
        batched fill runs the rows on a thread pool; on 2 cores it was slower at every batch size
        (128 rows: 4.1 us/row against 3.5 us/row one by one), so it is used only with many rows
        and at least BATCH_FILL_MIN_CPUS cores."""
        live: list[tuple[int, GrammarState]] = []
        for i in rows:
            g = seqs[i].grammar
            assert g is not None
            if g.is_terminated():
                g.fill(bitmask, i)  # only its stop tokens
            else:
                live.append((i, g))
        if not live:
            return
        if self._batch_fill_threads and len(live) >= BATCH_FILL_MIN_ROWS:
            import xgrammar as xgr

            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=self._batch_fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(
                [g.matcher for _, g in live], bitmask, [i for i, _ in live]
            )
        else:
            for i, g in live:
                g.matcher.fill_next_token_bitmask(bitmask, i)
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, g in live:
            if g.restrict is not None:
                groups.setdefault(id(g.restrict), (g.restrict, []))[1].append(i)
        for restrict, idxs in groups.values():
            idx = torch.tensor(idxs)
            words = bitmask[idx]
            narrowed = words & restrict
            # a row the restriction would leave empty keeps the grammar's mask (never sample from nothing)
            bitmask[idx] = torch.where(narrowed.ne(0).any(dim=1, keepdim=True), narrowed, words)

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        """Mask the constrained rows' logits (in place) to the tokens their grammars allow; the
        other rows are neither filled, copied nor read. On CUDA, xgrammar's Triton kernel applies
        the bitmask (copied from pinned memory); on the CPU a byte lookup table unpacks it, about
        twice as fast as xgrammar's CPU kernel (65 against 135 us per row of 49k tokens)."""
        vocab = logits.shape[1]
        bitmask = self._bitmask_rows(len(seqs), vocab)
        self._fill_grammar_masks(bitmask, seqs, rows)
        if logits.device.type == "cpu" and sys.byteorder == "little":
            idx = torch.tensor(rows)
            allowed = _bit_table()[bitmask[idx].view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
            neg_inf = logits.new_full((), float("-inf"))
            if len(rows) == logits.shape[0]:
                torch.where(allowed, logits, neg_inf, out=logits)
            else:
                logits.index_copy_(0, idx, torch.where(allowed, logits[idx], neg_inf))
            return
        import xgrammar as xgr

        mask = bitmask[: len(seqs)]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)  # pinned; the step's sync comes after
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)

    @staticmethod
    def _ban_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> torch.Tensor:
        """``min_tokens``: stop tokens (the request's, and EOS unless ``ignore_eos``) get -inf
        until the output has that many tokens, with one ``index_put_`` for all rows. A constrained
        row whose grammar allows nothing but those tokens (the document is complete) keeps them:
        the grammar wins, so the row ends instead of sampling from an empty distribution."""
        vocab = logits.shape[1]
        rows: list[int] = []
        toks: list[int] = []
        constrained: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if not p.min_tokens or s.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos_ids)
            banned = {t for t in banned if 0 <= t < vocab}
            if not banned:
                continue
            rows.extend([i] * len(banned))
            toks.extend(sorted(banned))
            if s.grammar is not None:
                constrained.append(i)
        if not rows:
            return logits
        packed = torch.tensor(rows + toks + constrained, dtype=torch.long).to(logits.device)
        n = len(rows)
        cidx = packed[2 * n :]
        before = logits[cidx] if constrained else None
        logits.index_put_((packed[:n], packed[n : 2 * n]), logits.new_full((), float("-inf")))
        if before is not None:
            after = logits[cidx]
            keep = torch.isfinite(after).any(dim=-1, keepdim=True)
            logits[cidx] = torch.where(keep, after, before)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        b, vocab = logits.shape
        dev = logits.device
        out_counts = torch.zeros(b, vocab, device=dev)
        seen = torch.zeros(b, vocab, dtype=torch.bool, device=dev)
        for i, s in enumerate(seqs):
            out_ids = s.output_token_ids
            if out_ids:
                ids = torch.tensor(out_ids, device=dev)
                out_counts[i].index_add_(0, ids, torch.ones(len(out_ids), device=dev))
            if s.params.repetition_penalty != 1.0:
                seen[i, torch.tensor(s.token_ids, device=dev)] = True
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev)[:, None]
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=dev)[:, None]
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev)[:, None]
        # repetition penalty (CTRL / HF semantics) on prompt and output tokens
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        # OpenAI presence/frequency penalties on output tokens
        logits = logits - freq * out_counts - pres * (out_counts > 0).float()
        return logits

    @staticmethod
    def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[1]
        if any(p.top_k for p in params):
            ks = torch.tensor([p.top_k if p.top_k else vocab for p in params], device=dev).clamp(max=vocab)
            kth = logits.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
            drop = (probs.cumsum(dim=-1) - probs) >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits
