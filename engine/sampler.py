"""Batched, vectorised sampling: logit bias, structured-output masks, penalties, temperature,
top-k, top-p, min-p, seeded generators, and top-N logprobs of the model's distribution for each
sampled token.

The order, per step: the model's log-softmax (for logprobs: they stay the model's distribution),
then ``logit_bias`` on the raw logits, then the grammar masks of the constrained rows, then
penalties, the ``min_tokens`` ban, temperature and the filters.

No per-row device work (issue 17): everything per row that the host knows (biases, banned tokens,
penalised token lists, the sampled rows' temperatures and filters, the rows that want logprobs) is
built on the host as flattened (row, token) lists and goes to the device in ONE copy (``_Upload``);
each lands with one ``index_put_``/``index_add_``; the logprobs are one gather and ONE ``topk``
(k = the largest N asked); everything the host needs back (tokens, logprobs, top ids and values)
comes in ONE ``.tolist()``, the step's only sync. The one per-row launch left is ``exponential_``
for each seeded row: each request's ``torch.Generator`` must draw the same numbers in the same
order as before, so that a fixed seed keeps its output, and a generator draws only by itself.
Rows without a bias, a grammar or a ban cost nothing."""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from batchery.engine import cpu_kernels
from batchery.engine.sampling import SamplingParams
from batchery.engine.sequence import Sequence, TokenLogprobs

if TYPE_CHECKING:
    from batchery.engine.structured import GrammarState

# xgrammar's BatchGrammarMatcher fills masks on a thread pool; it pays off only with many
# constrained rows and cores to spare (measured: see _fill_grammar_masks)
BATCH_FILL_MIN_ROWS = 64
BATCH_FILL_MIN_CPUS = 8


_BIT_TABLE: torch.Tensor | None = None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a [B, V] tensor, the same ids; on the CPU by the vectorized C++ kernel where it is
    built (torch's CPU argmax compares one element at a time: for 80 rows of SmolLM2's 49,152 bf16 logits on a
    2-core Zen 5 EPYC, torch took 3.0 ms to convert them to fp32 and take the argmax, the kernel 0.17 ms)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 and x.dtype in (torch.float32, torch.bfloat16):
        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)


def _bit_table() -> torch.Tensor:
    """[256, 8] bool: the bits of each byte, lowest first (a little-endian int32 bitmask viewed as
    bytes unpacks to token order)."""
    global _BIT_TABLE
    if _BIT_TABLE is None:
        _BIT_TABLE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.bool)
    return _BIT_TABLE


class _Upload:
    """The host vectors of one step, sent to the device in one copy.

    One int64 buffer: an int segment holds row indices or token ids, a float segment holds the
    bit patterns of float64 values (viewed back as float64 on the device, then rounded to float32
    exactly as ``torch.tensor([...])`` of the same Python floats rounds them). On an accelerator
    the copy is non-blocking: a blocking one waits for the stream, that is for the forward pass."""

    def __init__(self) -> None:
        self._buf = array("q")
        self._spans: list[tuple[int, int, bool]] = []

    def ints(self, values: Iterable[int]) -> int:
        start = len(self._buf)
        self._buf.extend(values)
        self._spans.append((start, len(self._buf) - start, False))
        return len(self._spans) - 1

    def floats(self, values: Iterable[float]) -> int:
        start = len(self._buf)
        self._buf.frombytes(array("d", values).tobytes())
        self._spans.append((start, len(self._buf) - start, True))
        return len(self._spans) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """The segments on ``device``, by the handles ``ints``/``floats`` returned. On the CPU
        they share the array's memory (``frombuffer`` keeps it alive)."""
        if not self._buf:
            return [torch.empty(0, dtype=torch.float64 if f else torch.long, device=device) for _, _, f in self._spans]
        buf = torch.frombuffer(self._buf, dtype=torch.int64)
        if device.type != "cpu":
            # through pinned memory: a copy from pageable memory may wait for the stream, that is for
            # the steps queued before this one (async scheduling keeps one queued); the caching host
            # allocator keeps the pinned block until the copy has read it
            pinned = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=device.type == "cuda")
            pinned.copy_(buf)
            buf = pinned.to(device, non_blocking=True)
        return [buf[o : o + n].view(torch.float64) if f else buf[o : o + n] for o, n, f in self._spans]


class SampledStep:
    """One step's sampled tokens (and logprobs), still on the device. ``tokens`` [num_rows] int64
    stays there for the next step to read (async scheduling takes its decode rows' input ids from
    it); ``back`` is everything the host needs, read in one go by ``result()``, the step's only
    sync. ``copy_to_host()`` starts that read early: on CUDA a non-blocking copy into pinned memory
    with an event, so that ``result()`` waits for this step alone, not for steps queued after it.
    ``needs_host``: a row's next step cannot be built before its token is on the host (a grammar
    mask, penalties over the output so far)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        back: torch.Tensor,
        needs_host: bool,
        lp_rows: list[int] | None = None,
        top_pos: list[int] | None = None,
        top_ns: list[int] | None = None,
        top_n: int = 0,
    ) -> None:
        self.tokens = tokens
        self.back = back
        self.needs_host = needs_host
        self.lp_rows = lp_rows  # None: no row asked for logprobs (``back`` is ``tokens``)
        self.top_pos = top_pos or []
        self.top_ns = top_ns or []
        self.top_n = top_n
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        if self.back.device.type != "cuda" or self._host is not None:
            return
        self._host = torch.empty(self.back.shape, dtype=self.back.dtype, pin_memory=True)
        self._host.copy_(self.back, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled token id and logprob entry of each row (waits for the device)."""
        if self._event is not None:
            self._event.synchronize()
        src = self._host if self._host is not None else self.back
        b = self.tokens.shape[0]
        if self.lp_rows is None:
            return src.tolist(), [None] * b
        back = src.tolist()
        token_list = [int(t) for t in back[:b]]
        lp_rows, top_pos, top_n = self.lp_rows, self.top_pos, self.top_n
        n_lp = len(lp_rows)
        entries: list[TokenLogprobs | None] = [None] * b
        for j, i in enumerate(lp_rows):
            entries[i] = {"token_id": token_list[i], "logprob": back[b + j], "top": []}
        ids_at = b + n_lp
        vals_at = ids_at + len(top_pos) * top_n
        for r, (j, n) in enumerate(zip(top_pos, self.top_ns, strict=True)):
            o = r * top_n
            entry = entries[lp_rows[j]]
            assert entry is not None
            entry["top"] = [
                (int(t), v) for t, v in zip(back[ids_at + o : ids_at + o + n], back[vals_at + o : vals_at + o + n])
            ]
        return token_list, entries


class Sampler:
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

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_seqs, vocab]. Returns the sampled token id and logprob entry of each seq."""
        return self.sample(logits, seqs, eos_ids).result()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> SampledStep:
        """The sampling of ``seqs`` from logits [num_seqs, vocab], queued on the device and not read
        back: the ``SampledStep`` holds the sampled ids as a device tensor (what the next step's
        decode rows take as input under async scheduling) and reads them on ``result()``."""
        b, vocab = logits.shape
        params = [s.params for s in seqs]
        up = _Upload()

        # -- the host's plan: every per-row list, into one upload ---------------------------------
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        all_lp = len(lp_rows) == b
        h_lp = up.ints(lp_rows) if lp_rows and not all_lp else -1
        top_pos = [j for j, i in enumerate(lp_rows) if params[i].logprobs]  # positions in lp_rows
        top_n = max((params[lp_rows[j]].logprobs or 0 for j in top_pos), default=0)
        h_top = up.ints(top_pos) if top_pos and len(top_pos) < len(lp_rows) else -1

        h_bias = self._plan_logit_bias(up, params, vocab)
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        h_pen = self._plan_penalties(up, seqs) if penalised else None
        h_ban = self._plan_ban(up, seqs, eos_ids, vocab)

        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        sp = [params[i] for i in sample_rows]
        all_sampled = len(sample_rows) == b
        h_idx = up.ints(sample_rows) if sample_rows and not all_sampled else -1
        h_temp = up.floats(p.temperature for p in sp) if sp else -1
        h_filters = self._plan_filters(up, sp, vocab)
        seeded = [j for j, p in enumerate(sp) if p.seed is not None]
        unseeded = [j for j, p in enumerate(sp) if p.seed is None]
        h_unseeded = up.ints(unseeded) if seeded and unseeded else -1

        d = up.send(logits.device)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if lp_rows or h_bias is not None or constrained or h_pen is not None or h_ban is not None or sample_rows:
            logits = logits.float()  # greedy rows alone take the argmax of the model's own logits (the same ids)

        # -- the device's work ----------------------------------------------------------------------
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = torch.log_softmax(logits if all_lp else logits[d[h_lp]], dim=-1)
        if h_bias is not None:
            rows, toks, vals = (d[h] for h in h_bias)
            logits.index_put_((rows, toks), vals.to(logits.dtype), accumulate=True)
        deferred: list[int] = []  # greedy constrained rows: their argmax is checked against the mask first
        bitmask = None
        if constrained:
            if h_pen is None and h_ban is None and logits.device.type == "cpu" and sys.byteorder == "little":
                deferred = [i for i in constrained if params[i].greedy]
            masked = [i for i in constrained if not params[i].greedy] if deferred else constrained
            bitmask = self._apply_grammars(logits, seqs, constrained, masked)
        if h_pen is not None:
            logits = self._apply_penalties(logits, h_pen, d)
        if h_ban is not None:
            logits = self._ban_stop_tokens(logits, h_ban, d)

        if sample_rows:
            sub = logits if all_sampled else logits[d[h_idx]]
            sub = sub / d[h_temp].float()[:, None]
            sub = self._apply_top_k_top_p_min_p(sub, h_filters, d)
            probs = torch.softmax(sub, dim=-1)
            if not seeded:
                noise = torch.empty_like(probs).exponential_(generator=self.generator)
            else:
                noise = torch.empty_like(probs)
                if unseeded:
                    drawn = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                        generator=self.generator
                    )
                    noise.index_copy_(0, d[h_unseeded], drawn)
                for j in seeded:  # one launch per seeded row: each generator draws only by itself
                    noise[j].exponential_(generator=self._generator_for(seqs[sample_rows[j]]))
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p.
            sampled = argmax_rows(probs / noise)
            if all_sampled:
                tokens = sampled
            else:
                tokens = argmax_rows(logits)  # the greedy rows; the sampled ones are overwritten
                tokens.index_copy_(0, d[h_idx], sampled)
        else:
            tokens = argmax_rows(logits)
        if deferred:
            assert bitmask is not None
            tokens = self._check_greedy_grammar_rows(logits, bitmask, tokens, deferred)

        needs_host = bool(constrained) or penalised
        if raw_logprobs is None:
            return SampledStep(tokens, tokens, needs_host)

        # -- logprobs: one gather, one topk, and everything back in one .tolist() -----------------------
        lp_tokens = tokens if all_lp else tokens[d[h_lp]]
        parts = [tokens.double(), raw_logprobs.gather(1, lp_tokens[:, None]).squeeze(1).double()]
        if top_n:
            src = raw_logprobs if h_top < 0 else raw_logprobs[d[h_top]]
            top_vals, top_ids = src.topk(top_n, dim=-1)
            parts += [top_ids.flatten().double(), top_vals.flatten().double()]
        top_ns = [params[lp_rows[j]].logprobs or 0 for j in top_pos]
        return SampledStep(tokens, torch.cat(parts), needs_host, lp_rows, top_pos, top_ns, top_n)

    @staticmethod
    def _plan_logit_bias(up: _Upload, params: list[SamplingParams], vocab: int) -> tuple[int, int, int] | None:
        """The (row, token, bias) triples of all rows with a ``logit_bias``, added to the raw
        logits with one ``index_put_``. Token ids outside the logits are skipped (the engine
        refuses them when the request comes in)."""
        if not any(p.logit_bias for p in params):
            return None
        rows: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            if not p.logit_bias:
                continue
            t, bias = p.logit_bias_items
            if t[-1] >= vocab:  # sorted: the largest id is last
                kept = [j for j, tok in enumerate(t) if tok < vocab]
                t, bias = [t[j] for j in kept], [bias[j] for j in kept]
            rows.extend([i] * len(t))
            toks.extend(t)
            vals.extend(bias)
        if not rows:
            return None
        return up.ints(rows), up.ints(toks), up.floats(vals)

    @staticmethod
    def _plan_penalties(up: _Upload, seqs: list[Sequence]) -> tuple[int, ...]:
        """Penalties from flattened token lists: each row's output tokens (counted, for presence
        and frequency) and, for rows with a repetition penalty, all its tokens (seen), with their
        lengths per row; the three penalties per row."""
        out_lens: list[int] = []
        seen_lens: list[int] = []
        out_toks = array("q")
        seen_toks = array("q")
        for s in seqs:
            out = s.token_ids[s.num_prompt_tokens :]
            out_lens.append(len(out))
            out_toks.extend(out)
            if s.params.repetition_penalty != 1.0:
                seen_lens.append(len(s.token_ids))
                seen_toks.extend(s.token_ids)
            else:
                seen_lens.append(0)
        return (
            up.ints(out_lens),
            up.ints(out_toks),
            up.ints(seen_lens),
            up.ints(seen_toks),
            up.floats(s.params.repetition_penalty for s in seqs),
            up.floats(s.params.presence_penalty for s in seqs),
            up.floats(s.params.frequency_penalty for s in seqs),
            len(out_toks),
            len(seen_toks),
        )

    @staticmethod
    def _plan_ban(up: _Upload, seqs: list[Sequence], eos_ids: list[int], vocab: int) -> tuple[int, int, int] | None:
        """``min_tokens``: the (row, stop token) pairs to ban, and the constrained rows among them."""
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
            return None
        return up.ints(rows), up.ints(toks), up.ints(constrained)

    @staticmethod
    def _plan_filters(up: _Upload, sp: list[SamplingParams], vocab: int) -> tuple[int, int, int, int, int]:
        """top-k: the largest k (a host number: no ``int(ks.max())`` sync), each row's k-1 and
        whether it has a k at all (a row without one does not make it ``topk(vocab)``); top-p and
        min-p per row. -1 where no row uses the filter."""
        k_max = min(vocab, max((p.top_k for p in sp), default=0))
        h_k = h_no_k = -1
        if k_max:
            h_k = up.ints(min(p.top_k, vocab) - 1 if p.top_k else 0 for p in sp)
            if not all(p.top_k for p in sp):
                h_no_k = up.ints(0 if p.top_k else 1 for p in sp)
        h_p = up.floats(p.top_p for p in sp) if any(p.top_p < 1.0 for p in sp) else -1
        h_min_p = up.floats(p.min_p for p in sp) if any(p.min_p > 0.0 for p in sp) else -1
        return k_max, h_k, h_no_k, h_p, h_min_p

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

    def _apply_grammars(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], masked: list[int] | None = None
    ) -> torch.Tensor:
        """Fill the bitmask rows of the constrained ``rows`` and mask the logits (in place) of those in ``masked``
        (default: all of them) to the tokens their grammars allow; the other rows are neither filled, copied nor
        read. Returns the bitmask. On CUDA, xgrammar's Triton kernel applies the bitmask (copied from pinned
        memory); on the CPU a byte lookup table unpacks it, about twice as fast as xgrammar's CPU kernel (65
        against 135 us per row of 49k tokens)."""
        bitmask = self._bitmask_rows(len(seqs), logits.shape[1])
        self._fill_grammar_masks(bitmask, seqs, rows)
        masked = rows if masked is None else masked
        if masked:
            self._mask_rows(logits, bitmask, masked)
        return bitmask

    def _check_greedy_grammar_rows(
        self, logits: torch.Tensor, bitmask: torch.Tensor, tokens: torch.Tensor, rows: list[int]
    ) -> torch.Tensor:
        """Greedy constrained rows whose logits were not masked: where the row's argmax is a token its grammar
        allows (most steps: the model already writes the document), the masked argmax is that same token (the
        first index of the row's largest value is also the first among the allowed ones), so the mask is
        skipped; the other rows are masked now and take the argmax again. The same ids as masking first, without
        unpacking a mask per row and step (CPU only; ``bitmask`` as ``_apply_grammars`` filled it)."""
        idx = torch.tensor(rows)
        tok = tokens.index_select(0, idx)
        words = bitmask[idx].gather(1, (tok >> 5)[:, None]).squeeze(1)
        allowed = ((words >> (tok & 31).to(words.dtype)) & 1).ne(0)
        if bool(allowed.all()):
            return tokens
        bad = [r for r, ok in zip(rows, allowed.tolist(), strict=True) if not ok]
        self._mask_rows(logits, bitmask, bad)
        bad_idx = torch.tensor(bad)
        tokens = tokens.clone()
        tokens.index_copy_(0, bad_idx, argmax_rows(logits.index_select(0, bad_idx)))
        return tokens

    def _mask_rows(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """-inf on the tokens that the filled bitmask rows ``rows`` do not allow, in place."""
        vocab = logits.shape[1]
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

        mask = bitmask[: logits.shape[0]]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)  # pinned; the step's sync comes after
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)

    @staticmethod
    def _ban_stop_tokens(logits: torch.Tensor, h: tuple[int, int, int], d: list[torch.Tensor]) -> torch.Tensor:
        """``min_tokens``: stop tokens (the request's, and EOS unless ``ignore_eos``) get -inf
        until the output has that many tokens, with one ``index_put_`` for all rows. A constrained
        row whose grammar allows nothing but those tokens (the document is complete) keeps them:
        the grammar wins, so the row ends instead of sampling from an empty distribution."""
        rows, toks, cidx = (d[i] for i in h)
        before = logits[cidx] if cidx.numel() else None
        logits.index_put_((rows, toks), logits.new_full((), float("-inf")))
        if before is not None:
            after = logits[cidx]
            keep = torch.isfinite(after).any(dim=-1, keepdim=True)
            logits[cidx] = torch.where(keep, after, before)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, h: tuple[int, ...], d: list[torch.Tensor]) -> torch.Tensor:
        """Repetition (CTRL / HF semantics, on prompt and output tokens), presence and frequency
        (OpenAI, on output tokens) penalties: the counts and the seen set are built on the device
        from the flattened lists, one ``index_add_`` and one ``index_put_``."""
        b, vocab = logits.shape
        dev = logits.device
        out_lens, out_toks, seen_lens, seen_toks = (d[i] for i in h[:4])
        rep, pres, freq = (d[i].float()[:, None] for i in h[4:7])
        n_out, n_seen = h[7], h[8]
        out_counts = torch.zeros(b * vocab, device=dev)
        seen = torch.zeros(b * vocab, dtype=torch.bool, device=dev)
        rows = torch.arange(b, device=dev)
        if n_out:
            flat = torch.repeat_interleave(rows, out_lens, output_size=n_out) * vocab + out_toks
            out_counts.index_add_(0, flat, torch.ones(n_out, device=dev))
        if n_seen:
            flat = torch.repeat_interleave(rows, seen_lens, output_size=n_seen) * vocab + seen_toks
            seen[flat] = True
        out_counts = out_counts.view(b, vocab)
        seen = seen.view(b, vocab)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - freq * out_counts - pres * (out_counts > 0).float()
        return logits

    @staticmethod
    def _apply_top_k_top_p_min_p(
        logits: torch.Tensor, h: tuple[int, int, int, int, int], d: list[torch.Tensor]
    ) -> torch.Tensor:
        """top-k by the k-th largest value of each row (one ``topk`` of the largest k; a row
        without top-k masks nothing), then top-p and min-p. The same masks as a per-row top-k:
        the k-th value is the same whatever larger k it is read from."""
        k_max, h_k, h_no_k, h_p, h_min_p = h
        if k_max:
            kth = logits.topk(k_max, dim=-1).values.gather(1, d[h_k][:, None])
            if h_no_k >= 0:
                kth = kth.masked_fill(d[h_no_k].bool()[:, None], float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if h_p >= 0:
            top_p = d[h_p].float()[:, None]
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
            drop = (probs.cumsum(dim=-1) - probs) >= top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        if h_min_p >= 0:
            min_p = d[h_min_p].float()[:, None]
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits
