"""Jump-forward end to end on the real default model (CPU): greedy outputs identical with it on and
off, fewer forward passes; retokenization at the boundary; UTF-8; preemption; stop strings."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from guided import LLM, SamplingParams
from guided.engine import drafts as drafts_module
from guided.engine.drafts import DraftProposer
from guided.engine.ngram import NgramIndex
from guided.fsm.jump_forward import (
    complete_utf8_prefix,
    propose_anchored_drafts,
    propose_draft_tokens,
    retokenize,
)
from guided.params import ConstraintSpec
from guided.scheduler import policy
from guided.scheduler.request import Request

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data"
UNICODE = "héllo wörld — 日本語"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm_on() -> LLM:
    return LLM(jump_forward=True, num_kv_blocks=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def llm_off() -> LLM:
    return LLM(jump_forward=False, num_kv_blocks=512, max_num_seqs=16)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def greedy(schema: dict, max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(json_schema=schema, temperature=0, max_tokens=max_tokens, **kw)


# ---- retokenize with the real tokenizer ---------------------------------------------------------

def test_retokenize_keeps_a_boundary_that_does_not_merge(llm_on):
    tok, token_bytes = llm_on.tokenizer, llm_on.engine.compiler.vocab.token_bytes
    hello = tok.encode("hello", add_special_tokens=False)
    world = tok.encode(" world", add_special_tokens=False)
    assert tok.encode("hello world", add_special_tokens=False) == hello + world  # the premise
    assert retokenize(tok, token_bytes, hello, b" world") == world


def test_retokenize_never_rewrites_committed_tokens(llm_on):
    tok, token_bytes = llm_on.tokenizer, llm_on.engine.compiler.vocab.token_bytes
    hel = tok.encode("hel", add_special_tokens=False)
    merged = tok.encode("hello world", add_special_tokens=False)
    assert merged[:len(hel)] != hel  # the premise: "hel" + "lo" merges into "hello"
    assert retokenize(tok, token_bytes, hel, b"lo world") == tok.encode(
        "lo world", add_special_tokens=False)


def test_retokenize_cuts_a_partial_utf8_character(llm_on):
    tok, token_bytes = llm_on.tokenizer, llm_on.engine.compiler.vocab.token_bytes
    data = UNICODE.encode()
    assert complete_utf8_prefix(data[:-1]) == UNICODE[:-1].encode()
    assert complete_utf8_prefix("é".encode()[:1]) == b""
    assert retokenize(tok, token_bytes, [], data[:-1]) == tok.encode(
        UNICODE[:-1], add_special_tokens=False)
    assert retokenize(tok, token_bytes, [], "é".encode()[:1]) == []
    # a boundary token that ends inside a character: wait until the character is complete
    partial = next(i for i, b in enumerate(token_bytes)
                   if b and b[-1] >= 0xC0 and not b.startswith(b"<"))
    assert retokenize(tok, token_bytes, [partial], b'"}') == []


def test_lookup_drafts_continue_past_the_forced_text_within_the_grammar(llm_on):
    tok, token_bytes = llm_on.tokenizer, llm_on.engine.compiler.vocab.token_bytes
    compiled = llm_on.engine.compiler.compile(ConstraintSpec(kind="regex", value=r'(ab|cd)+!'))
    matcher = compiled.matcher()
    # the output so far repeats "ab": the lookup proposes more of it, the grammar allows it
    out = tok.encode("abababab", add_special_tokens=False)
    for t in out:
        assert matcher.accept_token(t)
    index = NgramIndex()
    index.sync([], out)
    drafts, num_forced = propose_draft_tokens(tok, token_bytes, matcher, out, max_tokens=8,
                                              lookup=index, lookup_tokens=4)
    assert drafts and tok.decode(drafts).startswith("ab") and num_forced == 0
    assert propose_draft_tokens(tok, token_bytes, matcher, out, max_tokens=8) == ([], 0)
    # a lookup that leaves the grammar is cut where the grammar rejects it
    out2 = tok.encode("ab!ab", add_special_tokens=False)
    matcher = compiled.matcher()
    assert not all(matcher.accept_token(t) for t in out2)  # "ab!" ends the language
    matcher = compiled.matcher()
    prefix = tok.encode("ab", add_special_tokens=False)
    for t in prefix:
        assert matcher.accept_token(t)
    index = NgramIndex()
    index.extend(tok.encode("ab!xyz", add_special_tokens=False) + prefix)
    drafts, _ = propose_draft_tokens(tok, token_bytes, matcher, prefix, max_tokens=8,
                                     lookup=index, lookup_tokens=4)
    assert tok.decode(drafts) in ("", "!")  # "xyz" after "!" is outside the grammar
    assert matcher.accept_token(tok.encode("cd", add_special_tokens=False)[0])  # state unchanged


def test_lookup_drafts_stop_past_lookup_max_batch(llm_on, monkeypatch):
    """Above LOOKUP_MAX_BATCH running requests only forced text is drafted (here: none)."""
    monkeypatch.setattr(drafts_module, "LOOKUP_MAX_BATCH", 2)
    engine = llm_on.engine
    tok, token_bytes = llm_on.tokenizer, engine.compiler.vocab.token_bytes
    compiled = engine.compiler.compile(ConstraintSpec(kind="regex", value=r'(ab|cd)+!'))
    proposer = DraftProposer(engine._encoder, token_bytes, max_model_len=2048,
                             max_draft_tokens=None, special_ids=frozenset(), overlap=False)
    drafts = {}
    for num_running in (2, 3):
        out = tok.encode("abababab", add_special_tokens=False)
        request = Request(request_id=f"r{num_running}", prompt_token_ids=[1, 2], params=greedy(
            {"type": "string"}), seed=0, eos_token_ids=(), max_tokens=64)
        request.matcher = compiled.matcher()
        for t in out:
            assert request.matcher.accept_token(t)
        request.output_token_ids = out
        ask = proposer.plan(request, num_running=num_running)
        proposer.walk(request, ask)
        drafts[num_running] = request.draft_token_ids
    assert tok.decode(drafts[2]).startswith("ab")
    assert drafts[3] == []


def test_anchored_drafts_follow_the_assumed_tokens_and_the_guessed_sample(llm_on):
    """Overlap: the in-flight step feeds `assumed` and samples one unknown token; the
    proposal guesses it (the anchor: the forced text's first token) and drafts what follows."""
    tok, token_bytes = llm_on.tokenizer, llm_on.engine.compiler.vocab.token_bytes
    compiled = llm_on.engine.compiler.compile(ConstraintSpec(kind="regex",
                                                             value=r'(yes|no), then: the end'))
    matcher = compiled.matcher()
    out = tok.encode("yes", add_special_tokens=False)
    for t in out[:-1]:
        assert matcher.accept_token(t)
    # the last token of "yes" is in flight as a draft: the forced ", then: the end" follows it
    anchor, drafts, num_forced = propose_anchored_drafts(
        tok, token_bytes, matcher, out[:-1], out[-1:], max_tokens=16)
    want = retokenize(tok, token_bytes, out, b", then: the end")
    assert [anchor] + drafts == want and num_forced == len(drafts)
    assert propose_anchored_drafts(tok, token_bytes, matcher, out[:-1], out[-1:],
                                   max_tokens=2)[1] == want[1:3]  # cut after the anchor
    assert matcher.accept_token(out[-1])  # the matcher is unchanged: it takes that token
    # nothing forced at the start ("yes" or "no" is the model's choice): no anchor
    assert propose_anchored_drafts(tok, token_bytes, compiled.matcher(), [], [],
                                   max_tokens=8) == (None, [], 0)


# ---- on == off ----------------------------------------------------------------------------------

def sample_schemas(common) -> list:
    return (common.sample_stratified(common.load_jsonschemabench(
        DATA, ["Glaiveai2K", "Github_easy", "Kubernetes", "Snowplow", "JME", "BFCL_simple"]),
        6, seed=3) + common.load_bfcl_tool_schemas(DATA, 4, seed=3))


@pytest.mark.skipif(not (DATA / "jsonschemabench").is_dir() or not (DATA / "bfcl").is_dir(),
                    reason="shared data not present")
def test_on_equals_off_token_for_token_with_fewer_passes(llm_on, llm_off, bench_common):
    common = bench_common
    cases = sample_schemas(common)
    assert len(cases) == 10
    prompts = [llm_on.apply_chat_template(common.schema_messages(c.schema)) for c in cases]
    params = [greedy(c.schema) for c in cases]
    on = llm_on.generate(prompts, params)
    off = llm_off.generate(prompts, params)
    compared = 0
    for case, a, b in zip(cases, on, off):
        assert (a.finish_reason, a.error) == (b.finish_reason, b.error), case.id
        if a.finish_reason == "error":
            continue
        compared += 1
        assert a.token_ids == b.token_ids, (case.id, a.text, b.text)
        assert a.text == b.text
    assert compared >= 7
    passes_on = sum(o.metrics.forward_passes for o in on if o.finish_reason != "error")
    passes_off = sum(o.metrics.forward_passes for o in off if o.finish_reason != "error")
    assert passes_on < passes_off
    assert sum(o.metrics.jump_forward_tokens for o in on) > 0
    assert sum(o.metrics.jump_forward_tokens for o in off) == 0


def test_multibyte_forced_strings(llm_on, llm_off):
    schema = {"type": "object", "properties": {
        "greeting": {"const": UNICODE},
        "drink": {"enum": ["café au lait", "cafè noir"]}},  # é/è share their first byte
        "required": ["greeting", "drink"], "additionalProperties": False}
    prompt = chat(llm_on, "Greet me and pick a drink, as JSON.")
    on = llm_on.generate(prompt, greedy(schema))[0]
    off = llm_off.generate(prompt, greedy(schema))[0]
    assert on.finish_reason == off.finish_reason == "stop"
    assert on.token_ids == off.token_ids and on.text == off.text
    assert on.metrics.jump_forward_tokens > 0
    assert on.metrics.forward_passes < off.metrics.forward_passes
    value = json.loads(on.text)
    assert value["greeting"] == UNICODE and value["drink"] in ("café au lait", "cafè noir")


def test_stop_string_inside_a_forced_string(llm_on, llm_off):
    schema = {"type": "object", "properties": {"my_STOP_key": {"type": "string"}},
              "required": ["my_STOP_key"], "additionalProperties": False}
    prompt = chat(llm_on, "Answer as JSON.")
    on = llm_on.generate(prompt, greedy(schema, stop=["STOP"]))[0]
    off = llm_off.generate(prompt, greedy(schema, stop=["STOP"]))[0]
    assert on.finish_reason == off.finish_reason == "stop"
    assert on.stop_reason == "STOP" and on.text == off.text == '{"my_'
    assert on.token_ids == off.token_ids
    assert llm_on.engine.stats().kv_blocks_in_use == 0


def test_preemption_during_jump_forward(llm_on, monkeypatch):
    """A KV budget too small for the batch: requests are preempted (their drafts with them) and
    recomputed; the outputs equal those of a roomy engine and every block is returned."""
    schemas = [
        {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                          "year": {"type": "integer"}},
         "required": ["title", "year"], "additionalProperties": False},
        {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]},
                                          "population_in_millions": {"type": "number"}},
         "required": ["city", "population_in_millions"], "additionalProperties": False},
        {"type": "object", "properties": {"first_name": {"type": "string", "maxLength": 12},
                                          "last_name": {"type": "string", "maxLength": 12},
                                          "is_active_member": {"type": "boolean"}},
         "required": ["first_name", "last_name", "is_active_member"],
         "additionalProperties": False},
        {"type": "object", "properties": {"colors": {"type": "array", "maxItems": 4,
                                                     "items": {"enum": ["red", "green", "blue"]}}},
         "required": ["colors"], "additionalProperties": False},
    ]
    max_tokens = 64
    prompts = [chat(llm_on, f"Fill in this JSON object (example {i}).") for i in range(4)]
    params = [greedy(s, max_tokens) for s in schemas]
    need = [math.ceil((len(p) + max_tokens + 32) / 16) for p in prompts]
    monkeypatch.setattr(policy, "ADMISSION_LOOKAHEAD_TOKENS", 0)  # admit greedily: preempt
    tiny = LLM(jump_forward=True, num_kv_blocks=max(need) + 2,
               enable_prefix_caching=False, max_num_seqs=4)
    try:
        for schema in schemas:  # compiled first: all four requests then run at once
            tiny.engine.compiler.compile(ConstraintSpec.json_schema(schema))
        got = tiny.generate(prompts, params)
        stats = tiny.engine.stats()
        assert stats.preemptions_total > 0
        assert stats.kv_blocks_in_use == 0
        assert stats.jump_forward_tokens_total > 0
    finally:
        tiny.engine.shutdown()
    want = llm_on.generate(prompts, params)
    for a, b in zip(got, want):
        assert a.finish_reason == b.finish_reason
        assert a.token_ids == b.token_ids, (a.text, b.text)


def test_cached_encoder_equals_the_tokenizer(llm_on):
    from guided.fsm.jump_forward import CachedEncoder

    tok = llm_on.tokenizer
    enc = CachedEncoder(tok)
    for text in ('{"name": "', UNICODE, '"}, {"', "  leading spaces", "x" * 50, ""):
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)  # cached
    first = enc.encode("abc")
    first.append(-1)  # callers may change what they get
    assert enc.encode("abc") == tok.encode("abc", add_special_tokens=False)


FREE_FORM = [  # free-form maps and any-values: issue 42 saw on / off differ on the first
    {"type": "object", "properties": {
        "method": {"enum": ["GET", "POST", "PUT"]}, "url": {"type": "string", "maxLength": 40},
        "headers": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 20},
                    "maxProperties": 3}},
     "required": ["method", "url", "headers"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer"}, "meta": {"type": "object"}},
     "required": ["id", "meta"]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
]


@pytest.mark.parametrize("schema", FREE_FORM, ids=["http_headers", "any_object", "int_map"])
def test_on_equals_off_on_free_form_maps(llm_on, llm_off, schema):
    from jsonschema import Draft202012Validator

    prompt = chat(llm_on, "Write an HTTP request to fetch the example.com homepage, as JSON.")
    on = llm_on.generate(prompt, greedy(schema, max_tokens=96))[0]
    off = llm_off.generate(prompt, greedy(schema, max_tokens=96))[0]
    assert on.finish_reason == off.finish_reason and on.token_ids == off.token_ids, (on.text,
                                                                                     off.text)
    if on.finish_reason == "stop":
        assert not list(Draft202012Validator(schema).iter_errors(json.loads(on.text)))
