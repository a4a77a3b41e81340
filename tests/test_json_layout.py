"""How structured outputs lay JSON out (issue 39): the layouts the grammar fixes (``json_layout``:
indent, compact, any, any:N), the default (indent, ``json.dumps(indent=2)``: chosen by
``benchmarks/structured_vs_vllm.py``), the knob's errors at every door (engine, settings, request
body), vLLM's ``disable_any_whitespace`` / ``whitespace_pattern``, and the lexical mask that keeps raw
control bytes out of strings while letting the layout's newlines between tokens.

Real xgrammar, the real SmolLM2 tokenizer on a tiny random-weight Llama (``build_smol_tiny``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from test_structured_outputs import accepts, allowed_tokens, build_smol_tiny

from batchery.contract.schemas import ChatCompletionRequest, CompletionRequest
from batchery.contract.settings import Settings
from batchery.engine.config import EngineConfig
from batchery.engine.llm import LLM
from batchery.engine.sampling import SamplingParams
from batchery.engine.structured import DEFAULT_JSON_LAYOUT, GrammarCache, JsonLexer, StructuredOutputsParams

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "qty"],
    "additionalProperties": False,
}
CART = {  # arrays without maxItems, of strings and of objects
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["new", "sale", "gift"]}},
        "items": {"type": "array", "items": ITEM},
    },
    "required": ["tags", "items"],
    "additionalProperties": False,
}
DOC = {"tags": ["new", "gift"], "items": [{"name": "pear", "qty": 2}]}
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    return LLM(model=str(build_smol_tiny(tmp_path_factory.mktemp("smol-tiny"))), dtype="float32", num_kv_blocks=2048)


@pytest.fixture(scope="module")
def cache(llm) -> GrammarCache:
    return GrammarCache(llm.tokenizer, llm.engine.runner.vocab_size)


def spec(layout: str | None = None, schema: dict = CART) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, json_layout=layout)


def test_the_default_layout_is_json_dumps_indent_2(cache, llm):
    assert DEFAULT_JSON_LAYOUT == "indent" == EngineConfig().json_layout == Settings().engine.json_layout
    assert accepts(cache, spec(), json.dumps(DOC, indent=2))
    assert not accepts(cache, spec(), json.dumps(DOC))  # one line is another layout
    assert not accepts(cache, spec(), json.dumps(DOC, indent=4))
    assert not accepts(cache, spec(), json.dumps(DOC, indent=2).replace("\n  ", "\n   ", 1))  # no free whitespace
    # xgrammar keeps a value without a schema on one line, so JSON mode is json.dumps()'s layout
    assert accepts(cache, StructuredOutputsParams(json_object=True), '{"a": [1, {"b": null}]}')
    assert not accepts(cache, StructuredOutputsParams(json_object=True), '{\n  "a": 1\n}')
    assert accepts(cache, spec(), json.dumps({"tags": [], "items": []}, indent=2))  # json.dumps' empty arrays: []
    # the engine's default is its config's, and a request's own layout wins
    assert llm.engine.grammars.json_layout == "indent"
    assert accepts(llm.engine.grammars, spec(), json.dumps(DOC, indent=2))


@pytest.mark.parametrize(
    ("layout", "good", "bad"),
    [
        ("indent", [json.dumps(DOC, indent=2)], [json.dumps(DOC), json.dumps(DOC, separators=(",", ":"))]),
        ("compact", [json.dumps(DOC)], [json.dumps(DOC, indent=2), json.dumps(DOC, separators=(",", ":"))]),
        ("any", [json.dumps(DOC), json.dumps(DOC, indent=2), json.dumps(DOC, indent=8)], []),
        ("any:2", [json.dumps(DOC, separators=(",", ":")), json.dumps(DOC)], [json.dumps(DOC, indent=2)]),
        ("any:4", [json.dumps(DOC, indent=1)], [json.dumps(DOC, indent=2)]),  # "\n" and 3 spaces at most
    ],
)
def test_each_layout_is_what_it_says(cache, layout, good, bad):
    for text in good:
        assert accepts(cache, spec(layout), text), (layout, text)
    for text in bad:
        assert not accepts(cache, spec(layout), text), (layout, text)


def test_layouts_are_distinct_grammars_in_the_cache(cache):
    a, b = spec("indent"), spec("compact")
    assert a.key() != b.key() and spec().key("indent") == a.key() and spec().key("compact") == b.key()
    assert (
        StructuredOutputsParams(regex="[0-9]", json_layout="compact").key()
        == StructuredOutputsParams(regex="[0-9]").key()
    )


def test_a_newline_may_close_an_array_but_never_enters_a_string(cache, llm):
    """The indent layout closes an array with a newline (``"a"\\n  ]``) where ``,`` would go on, so a
    mask that banned every token with a control byte (the compact layout's) would leave a sampler
    only ``,``: an array without maxItems could never end. Inside a string a raw newline stays
    banned (xgrammar 0.2.9 lets control bytes into length-bounded strings)."""
    tok = llm.tokenizer
    vocab = llm.engine.runner.vocab_size
    pieces = cache.info.decoded_vocab  # a copy of the whole vocabulary at each access: read once
    newline = [t for t in range(vocab) if b"\n" in pieces[t]]
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def state_after(text: str):
        state = cache.matcher(spec())
        for t in tok.encode(text, add_special_tokens=False):
            assert state.accept(t), text
        state.fill(bitmask, 0)
        return state, set(allowed_tokens(bitmask, 0, vocab))

    state, allowed = state_after('{\n  "tags": [\n    "new"')  # after an item: ",\n    " or "\n  ]"
    assert state.lex == JsonLexer.OUT
    assert allowed & set(newline), "the newline that closes the array is offered"
    state, allowed = state_after('{\n  "tags": [],\n  "items": [\n    {\n      "name": "pe')  # in a bounded string
    assert state.lex == JsonLexer.IN
    assert allowed and not allowed & set(newline)
    assert not any(any(b < 0x20 for b in pieces[t]) for t in allowed if t not in cache.stop_token_ids)
    assert state.fork().lex == JsonLexer.IN


def test_the_lexer_follows_quotes_and_escapes(cache):
    lexer = cache.json_lexer()
    vocab = cache.info.decoded_vocab
    ids = {piece: i for i, piece in enumerate(vocab[: cache.vocab_size])}
    quote, backslash = ids[b'"'], ids[b"\\"]
    assert lexer.step[JsonLexer.OUT][quote] == JsonLexer.IN and lexer.step[JsonLexer.IN][quote] == JsonLexer.OUT
    assert lexer.step[JsonLexer.IN][backslash] == JsonLexer.ESC and lexer.step[JsonLexer.ESC][quote] == JsonLexer.IN
    nl = ids[b"\n"]
    on = lambda state, t: bool((int(lexer.rows[state][t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert on(JsonLexer.OUT, nl) and not on(JsonLexer.IN, nl) and not on(JsonLexer.ESC, nl)


def test_arrays_without_max_items_finish_on_a_tiny_model(llm):
    """A random-weight model knows no JSON: every choice between going on and closing an array is a
    coin the grammar hands it. In the indent layout the close (a newline) is offered, so sampled
    runs end their arrays and finish with ``stop``, valid; a greedy run may loop, as a real model
    can (that is what ``max_tokens`` is for), but never produces invalid JSON."""
    seeds = range(8)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured_outputs={"json": CART}) for s in seeds
    ]
    params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": CART}))
    outs = llm.generate(["Reply in JSON."] * len(params), params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    for o in finished:
        jsonschema.validate(json.loads(o.text), CART)
        assert o.text.startswith('{\n  "tags": [') and o.text.endswith("\n}"), o.text[:80]
    assert sum(o.finish_reason == "stop" for o in outs[: len(seeds)]) >= len(seeds) - 1, [o.text[-60:] for o in outs]
    for o in outs:
        assert o.finish_reason in ("stop", "length"), o.error


# -- the knob, at every door -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["tabs", "any:0", "any:65", "any:x", "any:01", "", "INDENT", 2])
def test_bad_layouts_are_refused_naming_the_field(bad, monkeypatch):
    with pytest.raises(ValueError, match="structured_outputs.json_layout must be indent, compact, any or any:N"):
        StructuredOutputsParams(json=CART, json_layout=bad)
    with pytest.raises(ValueError, match="json_layout must be indent, compact, any or any:N"):
        EngineConfig(json_layout=bad)
    with pytest.raises(ValueError, match="structured_outputs.json_layout" + (r"\n" if bad == 2 else " must be")):
        ChatCompletionRequest.model_validate(body(structured_outputs={"json": CART, "json_layout": bad}))
    if isinstance(bad, str) and bad:
        monkeypatch.setenv("BATCHERY_ENGINE__JSON_LAYOUT", bad)
        with pytest.raises(ValueError, match="BATCHERY_ENGINE__JSON_LAYOUT must be indent, compact, any or any:N"):
            Settings()


def body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


def test_vllms_whitespace_options():
    def constraint(**so):
        return ChatCompletionRequest.model_validate(body(structured_outputs={"json": CART, **so})).sampling()[
            "structured_outputs"
        ]

    assert constraint() == {"json": CART}  # the worker's default layout
    assert constraint(disable_any_whitespace=True) == {"json": CART, "json_layout": "compact"}
    assert constraint(disable_any_whitespace=False) == {"json": CART}
    assert constraint(json_layout="any:4") == {"json": CART, "json_layout": "any:4"}
    assert constraint(disable_any_whitespace=True, json_layout="compact")["json_layout"] == "compact"
    with pytest.raises(ValueError, match="disable_any_whitespace: true asks for the compact layout"):
        constraint(disable_any_whitespace=True, json_layout="indent")
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern\n.*whitespace patterns are not supp"):
        constraint(whitespace_pattern="[ ]?")
    with pytest.raises(ValueError, match="guided_whitespace_pattern\n.*send structured_outputs.json_layout"):
        ChatCompletionRequest.model_validate(body(guided_json=CART, guided_whitespace_pattern=" "))
    with pytest.raises(ValueError, match="guided_whitespace_pattern\n.*whitespace patterns are not supported"):
        CompletionRequest.model_validate({"prompt": "x", "guided_whitespace_pattern": " "})
    # a layout means nothing to a regex: it is dropped, not an error
    so = ChatCompletionRequest.model_validate(body(structured_outputs={"regex": "a", "json_layout": "compact"}))
    assert so.sampling()["structured_outputs"] == {"regex": "a"}
    params = SamplingParams(structured_outputs=constraint(disable_any_whitespace=True))  # what the worker builds
    assert params.structured is not None and params.structured.json_layout == "compact"
