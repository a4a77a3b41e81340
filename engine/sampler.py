"""Batched, vectorised sampling: penalties, temperature, top-k, top-p, min-p, seeded generators,
and top-N logprobs of the model's distribution for each sampled token."""

from __future__ import annotations

import torch

from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import Sequence, TokenLogprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

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

        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            logits = self._apply_grammars(logits, seqs, constrained)

        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._apply_penalties(logits, seqs)
        if any(p.min_tokens and s.num_output_tokens < p.min_tokens for s, p in zip(seqs, params, strict=True)):
            logits = logits.clone()
            for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
                if s.num_output_tokens < p.min_tokens:
                    banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                    if banned:
                        logits[i, list(banned)] = float("-inf")

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

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        """Mask the constrained rows' logits to the tokens their grammars allow; other rows pay nothing."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])  # rows of unconstrained seqs stay unread
        for i in rows:
            grammar = seqs[i].grammar
            assert grammar is not None
            grammar.fill(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
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
