"""Structured outputs (engine/structured.py, the sampler's grammar masks) with real xgrammar and the
real SmolLM2 tokenizer (byte-level pieces, 49,152 tokens) on a tiny random-weight Llama.

A random-weight model has no idea what JSON is: whatever it emits is the grammar's doing, so every
output that ends with ``stop`` validating against its schema (checked with ``jsonschema``) is a
strong test. The schemas bound every string, number and array, so the grammar forces an end within
``max_tokens`` whatever the model samples.

The last class runs the real SmolLM2 (slow): a schema and JSON mode on real prompts."""

from __future__ import annotations

import itertools
import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from batchery.engine.config import EngineConfig
from batchery.engine.llm import LLM
from batchery.engine.llm_engine import LLMEngine
from batchery.engine.loader import default_model_path
from batchery.engine.sampling import SamplingParams
from batchery.engine.structured import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    GrammarCache,
    StructuredOutputsParams,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "enum": ["apple", "pear", "fig"]},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["id", "items", "status"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "flagged": {"type": "boolean"},
        "summary": {"type": ["string", "null"], "maxLength": 10},
    },
    "required": ["sentiment", "score", "flagged", "summary"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "handle": {"type": "string", "pattern": "^@[a-z0-9_]{2,8}$"},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 10},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["handle", "address"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    },
    "required": ["user", "tags"],
    "additionalProperties": False,
}
EVENTS = {  # OpenAI strict style: $defs, anyOf with null, every property required
    "$defs": {
        "when": {
            "type": "object",
            "properties": {
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
            },
            "required": ["day", "month"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "events": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"enum": ["meeting", "call"]},
                    "when": {"anyOf": [{"$ref": "#/$defs/when"}, {"type": "null"}]},
                },
                "required": ["kind", "when"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["events"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "review": REVIEW, "nested": NESTED, "events": EVENTS}
PROMPT = "Reply in JSON."
MAX_TOKENS = 160  # far more than any of the bounded schemas can take
_rid = itertools.count()


def build_smol_tiny(path: Path) -> Path:
    """A 2-layer random-weight Llama with the real SmolLM2 tokenizer (taken from the cached GGUF)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def smol_tiny_dir(tmp_path_factory) -> Path:
    return build_smol_tiny(tmp_path_factory.mktemp("smol-tiny"))


@pytest.fixture(scope="module")
def llm(smol_tiny_dir) -> LLM:
    return LLM(model=str(smol_tiny_dir), dtype="float32", num_kv_blocks=1024)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def cache(llm) -> GrammarCache:
    """A private cache (the engine's is shared by all the tests of the module)."""
    return GrammarCache(llm.tokenizer, llm.engine.runner.vocab_size)


def so(**kw) -> dict:
    return {"structured_outputs": kw}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": MAX_TOKENS, **kw})


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, **{"max_tokens": MAX_TOKENS, **kw})


def accepts(cache: GrammarCache, spec: StructuredOutputsParams, text: str) -> bool:
    state = cache.matcher(spec)
    return bool(state.matcher.accept_string(text)) and bool(state.matcher.is_completed())


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = ((bitmask[row].to(torch.int64)[:, None] >> torch.arange(32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


# -- the constraint's parameters -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"json": PERSON, "regex": "a+"}, "exactly one of .* got json, regex"),
        ({"choice": []}, "choice must have at least one string"),
        ({"choice": "yes"}, "choice must be a list of strings"),
        ({"choice": ["yes", 3]}, r"choice\[1\] must be a non-empty string"),
        ({"choice": ["yes", ""]}, r"choice\[1\] must be a non-empty string"),
        ({"choice": ["x"] * (MAX_CHOICES + 1)}, f"more than the {MAX_CHOICES} allowed"),
        ({"choice": ["x" * 40_000, "y" * 40_000]}, f"more than the {MAX_CONSTRAINT_CHARS} allowed"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": 5}, "regex must be a non-empty string"),
        ({"grammar": ""}, "grammar must be a non-empty string"),
        ({"grammar": "root ::= " + '"a" | ' * 20_000 + '"b"'}, f"more than the {MAX_CONSTRAINT_CHARS} allowed"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "json must be a JSON object"),
        ({"json": 7}, "json must be a JSON object"),
        ({"json": {"enum": ["x" * 100] * 700}}, f"more than the {MAX_CONSTRAINT_CHARS} allowed"),
        ({"json": {"type": "number", "maximum": float("nan")}}, "json is not JSON"),
        ({"json_object": "yes"}, "json_object must be true or false"),
        ({"structural_tag": "nope"}, "structural_tag is not valid JSON"),
    ],
)
def test_invalid_constraints_raise_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_invalid_constraints_reach_sampling_params_as_value_errors():
    with pytest.raises(ValueError, match="structured_outputs: unknown field.*guided_json"):
        SamplingParams(structured_outputs={"guided_json": PERSON})
    with pytest.raises(ValueError, match="structured_outputs.choice must have at least one"):
        SamplingParams(structured_outputs={"choice": []})
    with pytest.raises(ValueError, match="structured_outputs must be an object"):
        StructuredOutputsParams.from_dict(["json"])  # type: ignore[arg-type]


def test_the_cache_key_is_the_constraint_not_its_spelling():
    as_dict = StructuredOutputsParams(json=PERSON)
    as_text = StructuredOutputsParams(json=json.dumps(PERSON, indent=2))
    assert as_dict.key() == as_text.key()
    assert as_dict.key() != StructuredOutputsParams(json=ORDER).key()
    # property order is part of the grammar (xgrammar emits properties in the schema's order)
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    assert StructuredOutputsParams(json=reordered).key() != as_dict.key()
    assert StructuredOutputsParams(choice=["a", "b"]).key() != StructuredOutputsParams(choice=["b", "a"]).key()
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    assert StructuredOutputsParams(regex="a+").key() != StructuredOutputsParams(grammar="a+").key()
    # the limits are inclusive
    StructuredOutputsParams(choice=[f"c{i}" for i in range(MAX_CHOICES)])
    StructuredOutputsParams(regex="a" * MAX_CONSTRAINT_CHARS)


# -- compiling: errors, the cache, threads --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": {"type": "objectx"}}, r"^invalid json constraint: Unsupported type \"objectx\"$"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "^invalid json constraint: .*minimum greater"),
        ({"json": {"type": "string", "pattern": "(("}}, "^invalid json constraint: .*parenthesis is not closed"),
        ({"json": {"$ref": "#/$defs/missing"}}, "^invalid json constraint: .*missing"),
        ({"regex": "[a-"}, "^invalid regex constraint: .*Unclosed '\\['"),
        ({"grammar": "root ::= foo"}, '^invalid grammar constraint: .*Rule "foo" is not defined'),
        ({"grammar": 'x ::= "a"'}, '^invalid grammar constraint: .*root rule with name "root" is not found'),
        ({"structural_tag": {"type": "nonsense"}}, "^invalid structural tag constraint: "),
    ],
)
def test_compile_errors_name_the_problem(cache, kwargs, message):
    spec = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=message) as err:
        cache.compile(spec)
    text = str(err.value)
    assert ".cc:" not in text and "Check failed" not in text  # xgrammar's source location is cut off
    assert len(text) < 500


def test_an_invalid_constraint_is_remembered(cache):
    spec = StructuredOutputsParams(json={"type": "integer", "minimum": 9, "maximum": 2})
    before = cache.stats()
    for _ in range(3):
        with pytest.raises(ValueError, match="minimum greater than maximum"):
            cache.compile(spec)
    after = cache.stats()
    assert after["num_errors"] - before["num_errors"] == 1
    assert after["num_hits"] - before["num_hits"] == 2
    assert after["num_compiled"] == before["num_compiled"]


def test_the_cache_compiles_each_constraint_once_and_evicts_least_recently_used(tokenizer, llm):
    cache = GrammarCache(tokenizer, llm.engine.runner.vocab_size, max_entries=2)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}") for i in (1, 2, 3)]
    g0 = cache.compile(specs[0])
    assert cache.compile(StructuredOutputsParams(regex="[a-z]{1}")) is g0
    cache.compile(specs[1])
    cache.compile(specs[0])  # the most recently used now: specs[1] goes first
    cache.compile(specs[2])
    st = cache.stats()
    assert (st["num_compiled"], st["num_hits"], st["num_cached"]) == (3, 2, 2)
    assert cache.compile(specs[0]) is g0  # still cached
    cache.compile(specs[1])  # evicted: compiled again
    assert cache.stats()["num_compiled"] == 4
    assert cache.stats()["cached_bytes"] > 0


def test_threads_asking_for_one_new_schema_compile_it_once(cache):
    schema = {**NESTED, "title": "threads"}  # new to this cache
    spec = StructuredOutputsParams(json=schema)
    before = cache.stats()
    barrier = threading.Barrier(8)
    results: list[object] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            results.append(cache.compile(StructuredOutputsParams(json=json.dumps(schema))))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 8 and all(r is results[0] for r in results)
    after = cache.stats()
    assert after["num_compiled"] - before["num_compiled"] == 1
    assert after["num_hits"] - before["num_hits"] == 7
    assert cache.compile(spec) is results[0]


@pytest.mark.parametrize("round_", range(4))
def test_threads_compiling_many_schemas_leave_a_consistent_cache(tokenizer, llm, round_):
    cache = GrammarCache(tokenizer, llm.engine.runner.vocab_size, max_entries=5)
    specs = [StructuredOutputsParams(json={**PERSON, "title": f"s{i}"}) for i in range(12)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(24):
                cache.compile(specs[(k * 5 + j) % len(specs)])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    st = cache.stats()
    assert st["num_compiled"] + st["num_hits"] == 4 * 24
    assert st["num_cached"] <= 5
    assert st["cached_bytes"] == sum(e.nbytes for e in cache._entries.values())  # evictions raced: once a bug


# -- what the grammars allow ------------------------------------------------------------------------


def test_json_has_one_layout_and_json_mode_is_an_object(cache):
    """Each layout is one fixed text per value (tests/test_json_layout.py has them all): here compact."""
    person = StructuredOutputsParams(json=PERSON, json_layout="compact")
    doc = {"name": "Ann", "age": 30, "email": "ann@x.com"}
    assert accepts(cache, person, json.dumps(doc))  # json.dumps' default layout
    assert not accepts(cache, person, json.dumps(doc, indent=2))  # no free whitespace
    assert not accepts(cache, person, json.dumps(doc, separators=(",", ":")))
    mode = StructuredOutputsParams(json_object=True)
    assert accepts(cache, mode, '{"a": [1, {"b": null}], "c": "d"}')
    assert not accepts(cache, mode, "[1, 2]")  # OpenAI's JSON mode is an object
    assert not accepts(cache, mode, '{\n  "a": 1\n}')


def test_schemas_are_strict_unless_they_allow_more(cache):
    extra = '{"name": "Ann", "age": 30, "email": "ann@x.com", "zzz": 1}'  # the compact layout
    loose = {k: v for k, v in PERSON.items() if k != "additionalProperties"}  # JSON Schema would allow "zzz"

    def compact(schema: dict) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=schema, json_layout="compact")

    assert not accepts(cache, compact(loose), extra)
    assert not accepts(cache, compact(PERSON), extra)
    assert accepts(cache, compact({**loose, "additionalProperties": True}), extra)
    # an object schema without properties is any object
    assert accepts(cache, StructuredOutputsParams(json={"type": "object"}), '{"k": [true]}')


def test_a_terminated_state_allows_only_stop_tokens_and_never_raises(cache, tokenizer, llm):
    state = cache.matcher(StructuredOutputsParams(choice=["yes"]))
    for tok in tokenizer.encode("yes", add_special_tokens=False):
        assert state.accept(tok)
    vocab = llm.engine.runner.vocab_size
    bitmask = torch.zeros((2, (vocab + 31) // 32), dtype=torch.int32)
    state.fill(bitmask, 1)
    assert allowed_tokens(bitmask, 1, vocab) == cache.stop_token_ids == [tokenizer.eos_token_id]
    assert state.accept(tokenizer.eos_token_id) and state.is_terminated()
    bitmask.fill_(-1)
    state.fill(bitmask, 0)  # xgrammar itself raises here
    assert allowed_tokens(bitmask, 0, vocab) == [tokenizer.eos_token_id]
    assert not state.accept(5) and state.num_rejected == 1
    fork = cache.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    copy = fork.fork()
    assert fork.accept(tokenizer.encode("no", add_special_tokens=False)[0])
    assert copy.accept(tokenizer.encode("yes", add_special_tokens=False)[0])  # independent positions


def test_the_cpu_mask_equals_xgrammars_kernel(cache, llm):
    """The sampler's CPU path unpacks the bitmask with a byte table; xgrammar's own kernel (what
    CUDA runs, as Triton) is the reference: the same logits come out, other rows untouched."""
    import xgrammar as xgr

    from batchery.engine.sampler import Sampler
    from batchery.engine.sequence import Sequence

    vocab = llm.engine.runner.vocab_size
    specs = [StructuredOutputsParams(json=SCHEMAS[k]) for k in SCHEMAS] + [StructuredOutputsParams(regex="[0-9]+")]

    def seq(i: int, constrained: bool) -> Sequence:
        return Sequence(str(i), [1], greedy(), grammar=cache.matcher(specs[i % len(specs)]) if constrained else None)

    some = [seq(i, i % 3 > 0) for i in range(9)]  # a gather of the constrained rows
    every = [seq(i, True) for i in range(5)]  # the path without a gather
    for seqs in (some, every):
        assert seqs[1].grammar.matcher.accept_string('{\n  "id": "ORD-1')  # type: ignore[union-attr]  # in a string
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        logits = torch.randn(len(seqs), vocab)
        expected = logits.clone()
        sampler = Sampler(torch.device("cpu"))
        sampler._apply_grammars(logits, seqs, rows)
        xgr.apply_token_bitmask_inplace(expected, sampler._bitmask[: len(seqs)], vocab_size=vocab, indices=rows)
        assert torch.equal(logits, expected)
        for i in rows:
            assert 0 < int(torch.isfinite(logits[i]).sum()) < vocab
        for i in set(range(len(seqs))) - set(rows):
            assert torch.isfinite(logits[i]).all()


# -- end to end on the tiny model --------------------------------------------------------------------


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    names = list(SCHEMAS)
    params = [greedy(**so(json=SCHEMAS[n])) for n in names]
    params += [sampled(seed, **so(json=SCHEMAS[n])) for n in names for seed in (1, 2, 3)]
    kinds = names + [n for n in names for _ in (1, 2, 3)]
    outs = llm.generate([PROMPT] * len(params), params)
    for kind, out in zip(kinds, outs):
        assert out.finish_reason == "stop", (kind, out.text, out.error)
        jsonschema.validate(json.loads(out.text), SCHEMAS[kind])
        assert out.token_ids[-1] == llm.tokenizer.eos_token_id  # the grammar ended it with EOS
    texts = [o.text for o in outs[len(names) :]]
    assert len(set(texts)) > len(texts) // 2  # sampling really sampled


def test_json_mode_output_is_an_object(llm, tokenizer):
    # the random model would wander through nested values forever: a bias on "}", and against the
    # tokens that open a key with the brace ('{"'), closes the object at once
    bias = {tokenizer.convert_tokens_to_ids("}"): 100.0}
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    bias.update({i: -100.0 for i, piece in enumerate(vocab) if piece.startswith("{") and piece != "{"})
    assert 1 < len(bias) <= 1024
    out = llm.generate(PROMPT, greedy(logit_bias=bias, **so(json_object=True)))[0]
    assert out.finish_reason == "stop"
    assert json.loads(out.text) == {}
    outs = llm.generate([PROMPT] * 3, [sampled(s, max_tokens=12, **so(json_object=True)) for s in (1, 2, 3)])
    for o in outs:  # unfinished objects: still the start of one object
        assert o.text.startswith("{") and o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_regex_output_fullmatches(llm):
    regex = r"(INV|REF)-[0-9]{3}-[a-z]{2,5}"
    params = [greedy(**so(regex=regex))] + [sampled(s, **so(regex=regex)) for s in range(1, 6)]
    for out in llm.generate([PROMPT] * len(params), params):
        assert out.finish_reason == "stop"
        assert re.fullmatch(regex, out.text), out.text


def test_choice_output_is_one_of_the_list(llm):
    choices = ["positive", "negative", 'say "neutral"', "mixed\nfeelings", "çà et là", "日本"]
    params = [greedy(**so(choice=choices))] + [sampled(s, **so(choice=choices)) for s in range(1, 13)]
    outs = llm.generate([PROMPT] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop" and out.text in choices, out.text
    assert len({o.text for o in outs}) >= 3  # sampling picks different ones


def test_ebnf_grammar_output_matches(llm):
    grammar = 'root ::= "(" num (" " op " " num){1,3} ")"\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?'
    regex = r"\([1-9][0-9]?( [+*-] [1-9][0-9]?){1,3}\)"
    params = [greedy(**so(grammar=grammar))] + [sampled(s, **so(grammar=grammar)) for s in range(1, 6)]
    for out in llm.generate([PROMPT] * len(params), params):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text


def test_one_schema_for_many_requests_compiles_once(llm):
    schema = {**PERSON, "title": "compiled once"}  # new to the engine's cache
    grammars = llm.engine.grammars
    before = grammars.stats()
    outs = llm.generate([PROMPT] * 6, [sampled(s, **so(json=schema)) for s in range(6)])
    assert all(o.finish_reason == "stop" for o in outs)
    after = grammars.stats()
    assert after["num_compiled"] - before["num_compiled"] == 1
    assert after["num_hits"] - before["num_hits"] == 5
    st = llm.engine.stats()
    assert st.get("grammar_compiled", after["num_compiled"]) == after["num_compiled"]


def test_an_invalid_schema_fails_only_its_request(llm):
    bad = so(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}})
    params = [greedy(**so(json=PERSON)), greedy(**bad), greedy(max_tokens=5), greedy(**so(regex="[0-9]{2}"))]
    outs = llm.generate([PROMPT] * 4, params)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == []
    assert outs[1].error is not None and outs[1].error.startswith("invalid json constraint:")
    assert "minimum greater than maximum" in outs[1].error
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 5
    assert re.fullmatch("[0-9]{2}", outs[3].text)


def test_max_tokens_mid_object_finishes_with_length(llm):
    out = llm.generate(PROMPT, greedy(max_tokens=4, **so(json=ORDER)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    head = '{\n  "id": "ORD-'  # the schema's first property (the indent layout), cut short
    assert out.text.startswith(head) or head.startswith(out.text), out.text
    with pytest.raises(ValueError):
        json.loads(out.text)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    rids = [f"s{next(_rid)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, params):
        engine.add_request(rid, p, sp)
    outs = {}
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs[o.request_id] = o
    assert not engine.has_unfinished()
    st = engine.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"], "KV blocks leaked"
    return [outs[r] for r in rids]


def test_preemption_keeps_the_matcher_and_the_outputs(llm, smol_tiny_dir):
    loaded = llm.engine.loaded
    texts = [f"Request {i}: reply in JSON about {w}." for i, w in enumerate("abcdefghijkl")]
    prompts = [llm.engine.encode(t) for t in texts]
    kinds = list(SCHEMAS) * 3
    params = [greedy(**so(json=SCHEMAS[k])) for k in kinds[: len(prompts)]]

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(smol_tiny_dir), dtype="float32", **kw), loaded=loaded)

    roomy = engine(num_kv_blocks=1024, block_size=8)
    reference = _run(roomy, prompts, params)
    assert roomy.stats()["num_preemptions"] == 0
    tight = engine(num_kv_blocks=48, block_size=8)  # 12 sequences of up to ~60 tokens: 8 blocks each
    outs = _run(tight, prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    for kind, out, ref in zip(kinds, outs, reference):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[kind])
        assert out.token_ids == ref.token_ids


def test_preemption_keeps_every_choices_matcher(llm, smol_tiny_dir):
    """n > 1 under preemption: each choice's grammar state survives its recomputation, and every
    choice's tokens equal those of a run with a pool large enough never to preempt."""
    loaded = llm.engine.loaded
    prompts = [llm.engine.encode(f"Request {i}: JSON about {w}.") for i, w in enumerate("abcdef")]
    kinds = list(SCHEMAS) * 2
    params = [sampled(40 + i, n=3, **so(json=SCHEMAS[k])) for i, k in enumerate(kinds[: len(prompts)])]

    def engine(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(smol_tiny_dir), dtype="float32", **kw), loaded=loaded)

    roomy = engine(num_kv_blocks=1024, block_size=8)
    reference = _run(roomy, prompts, params)
    assert roomy.stats()["num_preemptions"] == 0
    tight = engine(num_kv_blocks=48, block_size=8)
    outs = _run(tight, prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    for kind, out, ref in zip(kinds, outs, reference):
        assert len(out.outputs) == 3
        for o, r in zip(out.outputs, ref.outputs, strict=True):
            assert o.token_ids == r.token_ids
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMAS[kind])


def test_unconstrained_rows_are_untouched_by_constrained_ones(llm):
    texts = ["The cat sat on", "Once upon a time", "Numbers: 1, 2,", "Hello there"]
    plain = [greedy(max_tokens=24), greedy(max_tokens=24), sampled(7, max_tokens=24), greedy(max_tokens=24)]
    alone = llm.generate(texts, plain)
    mixed_params = [greedy(**so(json=ORDER)), *plain[:2], sampled(3, **so(choice=["a", "b"])), *plain[2:]]
    mixed = llm.generate([PROMPT, *texts[:2], PROMPT, *texts[2:]], mixed_params)
    got = [mixed[1], mixed[2], mixed[4], mixed[5]]
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[0].text), ORDER)
    assert mixed[3].text in ("a", "b")


def test_seeded_constrained_sampling_is_reproducible_in_any_batch(llm):
    p = sampled(11, **so(json=NESTED))
    alone = llm.generate(PROMPT, p)[0]
    crowd = llm.generate(
        ["x", PROMPT, "y z"], [sampled(1, **so(json=REVIEW)), p, sampled(2, max_tokens=30)]
    )  # another constrained row and an unconstrained one beside it
    assert crowd[1].token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), NESTED)


def test_batched_mask_fill_gives_the_same_outputs(llm, monkeypatch):
    """xgrammar's BatchGrammarMatcher (used with many rows on machines with many cores) fills the
    same masks as the per-row loop: forced on here, the outputs are the same token for token."""
    from batchery.engine import sampler as sampler_module

    params = [greedy(**so(json=SCHEMAS[k])) for k in SCHEMAS]
    params += [sampled(s, **so(json=ORDER)) for s in (1, 2)]
    params += [greedy(max_tokens=8, ignore_eos=True, **so(choice=["yes"])), greedy(max_tokens=20)]
    per_row = llm.generate([PROMPT] * len(params), params)
    sampler = llm.engine.runner.sampler
    monkeypatch.setattr(sampler_module, "BATCH_FILL_MIN_ROWS", 2)
    monkeypatch.setattr(sampler, "_batch_fill_threads", 2)
    batched = llm.generate([PROMPT] * len(params), params)
    assert sampler._batch_matcher is not None  # the batched path really ran
    assert [o.token_ids for o in batched] == [o.token_ids for o in per_row]
    for kind, out in zip(SCHEMAS, batched):
        jsonschema.validate(json.loads(out.text), SCHEMAS[kind])


def test_min_tokens_never_bans_the_eos_a_grammar_requires(llm, tokenizer):
    out = llm.generate(PROMPT, greedy(min_tokens=20, **so(choice=["yes"])))[0]
    assert out.finish_reason == "stop" and out.text == "yes"
    assert out.token_ids[-1] == tokenizer.eos_token_id and len(out.token_ids) < 20
    # where the grammar allows more than EOS, min_tokens still bans EOS: the regex goes on
    out = llm.generate(PROMPT, greedy(min_tokens=6, **so(regex="a{1,12}")))[0]
    assert out.finish_reason == "stop" and re.fullmatch("a{1,12}", out.text)
    assert len(out.token_ids) >= 6


def test_a_finished_grammar_ends_its_sequence_even_with_ignore_eos(llm, tokenizer):
    outs = llm.generate([PROMPT, "Hello"], [greedy(max_tokens=6, ignore_eos=True, **so(choice=["yes"])), greedy()])
    out = outs[0]
    assert out.finish_reason == "stop" and out.error is None and out.text == "yes"
    assert out.token_ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in out.token_ids[:-1]
    assert outs[1].finish_reason in ("stop", "length")


def test_logit_bias_cannot_break_a_grammar(llm, tokenizer):
    choices = ["yes", "no"]
    outside = tokenizer.convert_tokens_to_ids("{")
    no = tokenizer.encode("no", add_special_tokens=False)
    assert len(no) == 1
    outs = llm.generate(
        [PROMPT] * 3,
        [
            greedy(logit_bias={outside: 100.0}, **so(choice=choices)),  # forbidden by the grammar: no effect
            greedy(logit_bias={no[0]: 100.0}, **so(choice=choices)),  # allowed: chosen
            greedy(logit_bias={no[0]: -100.0}, **so(choice=["no"])),  # the only way: taken anyway
        ],
    )
    assert outs[0].text in choices
    assert outs[1].text == "no"
    assert outs[2].text == "no" and outs[2].finish_reason == "stop"


def test_logprobs_under_a_grammar_are_the_models(llm):
    free = llm.generate(PROMPT, greedy(max_tokens=1, logprobs=5))[0]
    constrained = llm.generate(PROMPT, greedy(max_tokens=1, logprobs=5, **so(json=PERSON)))[0]
    assert constrained.text.startswith("{")
    assert constrained.logprobs is not None and free.logprobs is not None
    top_free = [t for t, _ in free.logprobs[0]["top"]]
    top_constrained = [t for t, _ in constrained.logprobs[0]["top"]]
    assert top_constrained == top_free  # the model's top tokens, not the grammar's
    tok = constrained.token_ids[0]
    forced = llm.generate(PROMPT, greedy(max_tokens=1, logprobs=0, logit_bias={tok: 100.0}))[0]
    assert forced.token_ids == [tok] and forced.logprobs is not None
    # the raw model's value (about -log(49152) for a random model), not renormalised over the mask
    assert constrained.logprobs[0]["logprob"] == pytest.approx(forced.logprobs[0]["logprob"], abs=1e-5)
    assert constrained.logprobs[0]["logprob"] < -5


def test_n_choices_each_follow_the_grammar(llm):
    params = sampled(5, n=3, **so(json=ORDER))
    out = llm.generate(PROMPT, params)[0]
    outputs = out.outputs
    assert len(outputs) == 3
    for o in outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), ORDER)
    assert len({o.text for o in outputs}) > 1


# -- the real SmolLM2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return LLM(dtype="float32")


EXTRACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.integration
def test_real_model_json_schema_and_json_mode(smollm):
    people = ["Alice is 31 and lives in Paris.", "Bob, 45, is from Berlin.", "Chen (age 22) lives in Lima."]
    convs = [[{"role": "user", "content": f"Extract name, age and city as JSON: {p}"}] for p in people]
    convs.append([{"role": "user", "content": "Give a JSON object describing a cat with a name and a color."}])
    params = [greedy(max_tokens=80, **so(json=EXTRACT))] * 3 + [greedy(max_tokens=80, **so(json_object=True))]
    outs = smollm.chat(convs, params)
    for o in outs[:3]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), EXTRACT)
    assert [json.loads(o.text)["age"] for o in outs[:3]] == [31, 45, 22]
    assert outs[3].finish_reason == "stop", outs[3].text
    assert isinstance(json.loads(outs[3].text), dict)
