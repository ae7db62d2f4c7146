from __future__ import annotations

import json
import threading
import time

import pytest

from guided.fsm.settings import CompileSettings
from guided.errors import CompileTimeoutError, ConstraintError
from guided.fsm.compiler import WARM_UP_SCHEMA, CompiledGrammar, GrammarCompiler
from guided.params import ConstraintSpec


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=49152, config=CompileSettings(compile_threads=2))
    yield c
    c.shutdown()


SPECS = [
    ConstraintSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                "required": ["n"]}),
    ConstraintSpec("json_object", ""),
    ConstraintSpec("regex", "[0-9]{3}-[a-z]+"),
    ConstraintSpec.choice(["red", "green"]),
    ConstraintSpec("grammar", 'root ::= "(" [a-z]+ ")"'),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_each_kind_compiles(compiler, spec):
    grammar = compiler.compile(spec, timeout=60)
    assert isinstance(grammar, CompiledGrammar) and grammar.compile_seconds >= 0
    assert grammar.backend == "xgrammar"


def test_cache_hit_is_done_future(compiler):
    spec = ConstraintSpec("regex", "cache[0-9]+")
    first = compiler.compile(spec, timeout=60)
    future = compiler.submit(spec)
    assert future.done() and future.result() is first


def test_failures_are_cached(compiler):
    spec = ConstraintSpec("regex", "(unclosed")
    future = compiler.submit(spec)
    with pytest.raises(ConstraintError, match="regex"):
        future.result(timeout=60)
    again = compiler.submit(spec)
    assert again.done() and str(again.exception()) == str(future.exception())


def test_refusal_reaches_the_future(compiler):
    future = compiler.submit(ConstraintSpec.json_schema({"not": {"type": "string",
                                                                  "minLength": 3}}))
    with pytest.raises(ConstraintError, match="'not' at /"):
        future.result(timeout=60)


@pytest.mark.parametrize("spec", [ConstraintSpec("regex", "\U00040000"),
                                  ConstraintSpec.choice(["\U00050000", "\U00060000"])])
def test_a_grammar_no_token_can_start_is_refused(compiler, spec):
    # SmolLM2 has no token for the UTF-8 lead bytes F1 and F2 (planes 4-11 start with them)
    with pytest.raises(ConstraintError, match="no token can start it"):
        compiler.compile(spec)


def test_size_limit(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=49152,
                        config=CompileSettings(max_grammar_bytes=100))
    try:
        future = c.submit(ConstraintSpec("regex", "a" * 101))
        assert future.done()
        with pytest.raises(ConstraintError, match="max_grammar_bytes"):
            future.result()
    finally:
        c.shutdown()


class Gate:
    """Compiles of specs whose text starts with "slow" wait for the gate (an uninterruptible
    compile, like xgrammar's C++ one), then compile for real."""

    def __init__(self, compiler: GrammarCompiler):
        self.opened = threading.Event()
        self.started: list[str] = []
        real = compiler._compile_sync

        def compile_sync(spec):
            if spec.value.startswith("slow"):
                self.started.append(spec.value)
                self.opened.wait(10)
            return real(spec)

        compiler._compile_sync = compile_sync


@pytest.fixture
def gated(tokenizer):
    """(compiler, gate): one compile thread, a 0.3 s compile timeout."""
    c = GrammarCompiler(tokenizer, vocab_size=49152,
                        config=CompileSettings(compile_threads=1, compile_timeout_s=0.3))
    gate = Gate(c)
    yield c, gate
    gate.opened.set()
    c.shutdown()


def wait_cached(c: GrammarCompiler, spec: ConstraintSpec) -> CompiledGrammar:
    """The spec's cached grammar, once its compile (in the background) has ended."""
    deadline = time.monotonic() + 30
    while True:
        ticket = c.submit(spec)
        if ticket.done() and not isinstance(ticket.exception(), CompileTimeoutError):
            return ticket.result()
        ticket.cancel()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_submit_never_blocks_and_a_timeout_is_retryable_never_cached(gated):
    c, gate = gated
    spec = ConstraintSpec("regex", "slow[0-9]")
    start = time.perf_counter()
    future = c.submit(spec)
    assert time.perf_counter() - start < 0.05 and not future.done()
    with pytest.raises(CompileTimeoutError, match="timed out"):
        future.result(timeout=5)
    # meanwhile: the same spec is answered at once (retry later), a fast one goes through on
    # the worker that replaced the stuck one
    with pytest.raises(CompileTimeoutError, match="still compiling"):
        c.submit(spec).result(timeout=0.1)
    assert c.compile(ConstraintSpec("regex", "fast"), timeout=30).backend == "xgrammar"
    gate.opened.set()  # the compile ends in the background and fills the cache
    assert wait_cached(c, spec).spec == spec


def test_a_queued_compile_nobody_waits_for_is_dropped(gated):
    c, gate = gated
    running = c.submit(ConstraintSpec("regex", "slow1"))
    queued = c.submit(ConstraintSpec("regex", "slow2"))
    while not gate.started:
        time.sleep(0.01)
    assert c._pool.num_queued == 1
    queued.cancel()
    assert c._pool.num_queued == 0
    again = c.submit(ConstraintSpec("regex", "slow2"))  # the next submit starts afresh
    assert not again.done() and c._pool.num_queued == 1
    again.cancel()
    gate.opened.set()
    running.exception(timeout=30)  # compiled, or timed out (0.3 s) and still cached
    assert wait_cached(c, ConstraintSpec("regex", "slow1")).backend == "xgrammar"
    assert gate.started == ["slow1"]


def test_a_running_compile_nobody_waits_for_frees_its_worker_and_still_fills_the_cache(gated):
    c, gate = gated
    spec = ConstraintSpec("regex", "slow3")
    ticket = c.submit(spec)
    while not gate.started:
        time.sleep(0.01)
    ticket.cancel()
    # its worker was replaced at once: a new compile does not wait for the abandoned one
    assert c.compile(ConstraintSpec("regex", "quick"), timeout=10).backend == "xgrammar"
    gate.opened.set()
    assert wait_cached(c, spec).spec == spec


def test_a_compile_queue_too_deep_refuses_new_specs_at_once(gated, monkeypatch):
    c, gate = gated
    first = c.submit(ConstraintSpec("regex", "slow4"))  # runs
    while not gate.started:
        time.sleep(0.01)
    # as if compiles held their worker 0.3 s (compile_timeout_s): none queued would start in time
    c._pool._mean_s = 0.3
    with pytest.raises(CompileTimeoutError, match="busy"):
        c.submit(ConstraintSpec("regex", "slow5")).result(timeout=0.1)
    assert c._pool.num_queued == 0
    c._pool._mean_s = 0.0
    monkeypatch.setattr("guided.fsm.compiler.MAX_QUEUED_COMPILES", 0)
    with pytest.raises(CompileTimeoutError, match="waiting to compile"):
        c.submit(ConstraintSpec("regex", "slow6")).result(timeout=0.1)
    offline = c.submit(ConstraintSpec("regex", "slow7"), bounded=False)  # an offline batch's
    gate.opened.set()
    first.exception(timeout=30)
    assert "waiting to compile" not in str(offline.exception(timeout=30) or "")  # queued


def test_length_bounded_strings_stay_valid_json_under_random_tokens(compiler):
    """A random-weight model walks a grammar almost uniformly; inside strings with minLength /
    maxLength xgrammar's own rule admitted raw control characters (invalid JSON). Every random
    walk must end in text that parses and validates."""
    import json
    import random

    import jsonschema
    import torch

    schema = {"type": "object", "properties": {
        "id": {"type": "string", "maxLength": 6},
        "code": {"type": "string", "minLength": 2, "maxLength": 4},
        "note": {"type": ["string", "null"], "minLength": 1},
        "text": {"type": "string", "maxLength": 1000}},  # past the pattern rewrite's bound
        "required": ["id", "code", "note", "text"], "additionalProperties": False}
    grammar = compiler.submit(ConstraintSpec("json_schema", json.dumps(schema))).result(60)
    token_bytes = compiler.vocab.token_bytes
    control = [i for i, b in enumerate(token_bytes) if b and min(b) < 0x20]
    bitmask = torch.zeros(1, -(-len(token_bytes) // 32), dtype=torch.int32)
    rng = random.Random(0)
    for _ in range(20):
        matcher, text = grammar.matcher(), b""
        for _ in range(60):
            matcher.fill_bitmask(bitmask, 0)
            bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()
            allowed = bits[:len(token_bytes)].nonzero().flatten().tolist()
            assert not set(allowed) & set(control)
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
            text += token_bytes[token]
        if matcher.is_terminated():
            jsonschema.validate(json.loads(text), schema)
    # the batched fill (xgrammar's BatchGrammarMatcher) applies the same exclusion
    from guided.masks.bitmask_fill import fill_draft_rows

    matchers = [grammar.matcher() for _ in range(3)]
    for m, prefix in zip(matchers, [b'{"id": "a', b'{"id": "", "code": "ab', b'{"id": "", "code": '
                                    b'"ab", "note": null, "text": "x']):
        assert m.accept_bytes(prefix)
    rows = torch.zeros(3, bitmask.shape[1], dtype=torch.int32)
    fill_draft_rows([(m, [], i) for i, m in enumerate(matchers)], rows, num_threads=2)
    bits = ((rows.unsqueeze(2) >> torch.arange(32)) & 1).flatten(1)[:, :len(token_bytes)]
    assert bits.sum() > 0 and not bits[:, control].any()
    # rows a ban does not cover (here: -1, as a finished request's) keep every bit, and the
    # covered ones equal the one-row fill's
    spread = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    fill_draft_rows([(m, [], 2 * i) for i, m in enumerate(matchers)], spread, num_threads=1)
    assert (spread[1] == -1).all() and (spread[3] == -1).all()
    for i, m in enumerate(matchers):
        m.fill_bitmask(bitmask, 0)
        assert torch.equal(spread[2 * i], bitmask[0]) and torch.equal(spread[2 * i], rows[i])


@pytest.mark.parametrize("low,high", [(0, 10), (3, 64), (0, 65), (60, 130), (128, 128),
                                      (1, 300), (70, None)])
def test_length_bounds_accept_exactly_the_allowed_lengths(compiler, low, high):
    """minLength / maxLength compile to a counted pattern (in blocks past 64 characters):
    a string closes exactly when its length is in bounds, a multi-byte character counting one,
    as jsonschema counts them."""
    import json
    import random

    import jsonschema

    node = {"type": "string", "minLength": low}
    if high is not None:
        node["maxLength"] = high
    schema = {"type": "object", "properties": {"s": node}, "required": ["s"],
              "additionalProperties": False}
    grammar = compiler.submit(ConstraintSpec("json_schema", json.dumps(schema))).result(120)
    rng = random.Random(low)
    top = (high or low + 70) + 2
    for n in sorted({0, 1, low - 1, low, low + 1, top - 3, top - 2, top - 1,
                     rng.randrange(top)} - {-1}):
        chars = [rng.choice(["a", "é", "日", "😀", " "]) for _ in range(n)]
        body = '{"s": "' + "".join(chars)
        matcher = grammar.matcher()
        fits = high is None or n <= high
        assert matcher.accept_bytes(body.encode()) == fits, n
        if fits:
            closes = matcher.accept_bytes(b'"}')
            assert closes == (n >= low), n
            if closes:
                jsonschema.validate(json.loads(body + '"}'), schema)


def test_a_required_name_behind_a_custom_ref_is_enforced(compiler):
    """JSONSchemaBench (Azure): a $ref into "resourceDefinitions", whose target requires a
    property it does not declare; an answer without it was accepted and failed validation."""
    import json

    schema = {"resourceDefinitions": {"gw": {"type": "object",
                                             "properties": {"name": {"type": "string"}},
                                             "required": ["location", "name"]}},
              "type": "object", "properties": {"gw": {"$ref": "#/resourceDefinitions/gw"}},
              "required": ["gw"]}
    grammar = compiler.submit(ConstraintSpec("json_schema", json.dumps(schema))).result(60)
    matcher = grammar.matcher()
    assert matcher.accept_bytes(b'{"gw": {"name": "a"')
    assert not matcher.accept_bytes(b"}")  # "location" is still missing
    matcher = grammar.matcher()
    assert matcher.accept_bytes(b'{"gw": {"name": "a", "location": 1}}')


def test_warm_up_builds_the_first_compiles_work_ahead_of_them(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    try:
        assert compiler._llguidance is None
        compiler.warm_up()
        assert compiler._llguidance is not None  # llguidance's tokenizer: built once, here
        ticket = compiler.submit(ConstraintSpec("json_schema", WARM_UP_SCHEMA))
        assert ticket.done() and ticket.result().backend == "xgrammar"  # compiled, cached
    finally:
        compiler.shutdown()


def test_warm_up_without_llguidance_leaves_every_schema_to_xgrammar(tokenizer, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if it were not installed
    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    try:
        compiler.warm_up()  # no raise: a server still starts
        assert compiler._llguidance is None
        long_string = {"type": "string", "minLength": 300, "maxLength": 400}  # llguidance's kind
        grammar = compiler.compile(ConstraintSpec("json_schema", json.dumps(long_string)),
                                   timeout=120)
        assert grammar.backend == "xgrammar"
    finally:
        compiler.shutdown()
