"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice list,
grammar, structural tag), compiled once per distinct constraint into an xgrammar grammar, and a
per-sequence matcher that the sampler masks logits with and the scheduler advances with every
sampled token.

Why xgrammar: it is the backend vLLM, SGLang and TensorRT-LLM share, so a schema that works
there works here; it compiles JSON Schema, regular expressions, EBNF and structural tags
(tool calls) to a token-level pushdown automaton with a per-tokenizer cache, fills a
vocabulary bitmask in microseconds on the CPU, and runs the same on CPU and CUDA.

Compilation runs in the caller's thread (the engine service compiles in the task's thread,
off the engine loop); the cache is shared by every engine built on the same loaded model."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_CACHED_GRAMMARS = 256  # distinct constraints kept compiled (LRU)
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (vLLM's field names). Exactly one of the fields is set."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False  # any JSON object (OpenAI's JSON mode)
    structural_tag: dict | str | None = None  # an xgrammar structural tag (tool calls use these)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {', '.join(set_) or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint: the cache key (equal constraints, one grammar)."""
        value = getattr(self, self.kind)
        if isinstance(value, str) and self.kind in ("json", "structural_tag"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        unknown = set(d) - set(KINDS)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
        return cls(**d)


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCache:
    """Compiled grammars for one tokenizer, by constraint; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.num_compiled = 0
        self.num_hits = 0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` naming the problem if it is invalid."""
        key = spec.key()
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                self.num_hits += 1
                return hit
        c = self.compiler
        try:
            kind = spec.kind
            if kind == "json":
                compiled = c.compile_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
            elif kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif kind == "choice":
                alts = " | ".join(json.dumps(s) for s in spec.choice or ())
                compiled = c.compile_grammar(f"root ::= {alts}")
            elif kind == "grammar":
                compiled = c.compile_grammar(spec.grammar)
            else:
                tag = spec.structural_tag
                compiled = c.compile_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on bad input
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')} constraint: {exc}") from None
        with self._lock:
            self._compiled[key] = compiled
            self.num_compiled += 1
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)))


_CACHES_LOCK = threading.Lock()


def grammar_cache(owner: Any, tokenizer: Any, vocab_size: int) -> GrammarCache:
    """The grammar cache kept on ``owner`` (the loaded model, so a rebuilt engine keeps it)."""
    with _CACHES_LOCK:
        cache = getattr(owner, "_batchery_grammars", None)
        if cache is None:
            cache = GrammarCache(tokenizer, vocab_size)
            object.__setattr__(owner, "_batchery_grammars", cache)
        return cache
