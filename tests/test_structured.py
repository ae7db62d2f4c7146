"""Structured generation end to end on the real default model (CPU): mixed constrained batches,
compiles that never block the step loop, failed compiles that fail only their own request."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from guided import LLM, SamplingParams
from guided.errors import ConstraintError
from guided.scheduler.request import RequestStatus

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
PALETTE = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "shades": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["color", "shades"], "additionalProperties": False}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["sunny", "rainy", "cloudy"]
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'
GRAMMAR_RE = r"The answer is (yes|no)\."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512, max_num_seqs=8)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def is_valid(schema: dict, text: str) -> bool:
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(json.loads(text))


def test_mixed_batch_decodes_together_and_every_output_is_valid(llm):
    requests = [
        ("Tell me a joke.", SamplingParams(max_tokens=16, temperature=0)),
        ("Describe a person as JSON.", SamplingParams(json_schema=PERSON, temperature=0,
                                                      max_tokens=96)),
        ("Pick a color and some shades as JSON.", SamplingParams(json_schema=PALETTE,
                                                                 temperature=0, max_tokens=96)),
        ("Give me a phone number.", SamplingParams(regex=PHONE, temperature=0, max_tokens=16)),
        ("What is the weather like?", SamplingParams(choice=CHOICES, temperature=0,
                                                     max_tokens=16)),
        ("Describe a cat as a JSON object with two short fields.",
         SamplingParams(json_object=True, temperature=0, max_tokens=128)),
        ("Is the sky blue?", SamplingParams(grammar=GRAMMAR, temperature=0, max_tokens=16)),
    ]
    outs = llm.generate([chat(llm, text) for text, _ in requests], [p for _, p in requests])
    free, person, palette, phone, choice, obj, grammar = outs
    assert free.finish_reason in ("stop", "length") and free.text
    for out in (person, palette, phone, choice, obj, grammar):
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    assert is_valid(PERSON, person.text), person.text
    assert is_valid(PALETTE, palette.text), palette.text
    assert re.fullmatch(PHONE, phone.text), phone.text
    assert choice.text in CHOICES
    assert isinstance(json.loads(obj.text), dict), obj.text
    assert re.fullmatch(GRAMMAR_RE, grammar.text), grammar.text
    assert llm.engine.stats().kv_blocks_in_use == 0


def test_a_slow_compile_does_not_hold_back_other_requests(llm, monkeypatch):
    """The slow request's compile is held until the unconstrained requests have finished: if the
    step loop waited for compiles it could not finish them, and the compile would run late."""
    compiler = llm.engine.compiler
    compile_sync = compiler._compile_sync
    release = threading.Event()
    started = threading.Event()

    def held_compile(spec):
        if "slow_marker" in spec.value:
            started.set()
            release.wait(timeout=120)
        return compile_sync(spec)

    monkeypatch.setattr(compiler, "_compile_sync", held_compile)
    schema = {"type": "object", "properties": {"slow_marker": {"type": "boolean"}},
              "required": ["slow_marker"], "additionalProperties": False}
    engine = llm.engine
    engine.add_request("slow", chat(llm, "Answer as JSON."),
                       SamplingParams(json_schema=schema, temperature=0, max_tokens=32))
    for i in range(2):
        engine.add_request(f"free-{i}", chat(llm, f"Count to {i + 5}."),
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done: dict[str, object] = {}
    steps_while_compiling = 0
    while len(done) < 3:
        if not release.is_set() and {"free-0", "free-1"} <= done.keys():
            assert engine.requests["slow"].status is RequestStatus.WAITING_FOR_GRAMMAR
            release.set()
        if not release.is_set():
            steps_while_compiling += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert started.is_set() and release.is_set()
    assert steps_while_compiling >= 8  # the unconstrained requests decoded every token meanwhile
    assert [len(done[f"free-{i}"].token_ids) for i in range(2)] == [8, 8]
    slow = done["slow"]
    assert slow.finish_reason == "stop" and is_valid(schema, slow.text), slow.text
    assert slow.metrics.compiled_time > max(done[f"free-{i}"].metrics.finished_time
                                            for i in range(2))


def test_a_failed_compile_fails_only_its_own_request(llm):
    refused = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    requests = [
        SamplingParams(grammar='root ::= "a" | ', max_tokens=8),  # broken EBNF
        SamplingParams(json_schema=refused, max_tokens=8),
        SamplingParams(regex="(unclosed", max_tokens=8),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(regex=PHONE, temperature=0, max_tokens=16),
    ]
    outs = llm.generate([chat(llm, "Hello.")] * len(requests), requests)
    for out in outs[:3]:
        assert out.finish_reason == "error" and out.error_type == "constraint", out
        assert out.error and out.token_ids == []
    assert "uniqueItems" in outs[1].error
    assert outs[3].finish_reason == "length" and len(outs[3].token_ids) == 8
    assert outs[4].finish_reason == "stop" and re.fullmatch(PHONE, outs[4].text)
    assert llm.engine.stats().kv_blocks_in_use == 0
    with pytest.raises(ConstraintError, match="not valid JSON"):
        _ = SamplingParams(json_schema="{not json").constraint


@pytest.mark.skipif(not (DATA / "jsonschemabench").is_dir(), reason="shared data not present")
def test_a_sample_of_compliance_schemas_is_valid_or_refused(llm, bench_common):
    common = bench_common
    subsets = ["Glaiveai2K", "Github_easy", "Kubernetes", "Snowplow", "JME", "BFCL_simple"]
    cases = common.sample_stratified(common.load_jsonschemabench(DATA, subsets), 8, seed=7)
    params = [SamplingParams(json_schema=c.schema, temperature=0, max_tokens=96) for c in cases]
    outs = llm.generate([chat(llm, common.schema_messages(c.schema)[0]["content"])
                         for c in cases], params)
    judged = 0
    for case, out in zip(cases, outs):
        if out.finish_reason == "error":
            assert out.error_type == "constraint" and out.error, (case.id, out.error)
        elif out.finish_reason == "stop":
            judged += 1
            assert common.validation_error(case.schema, out.text) is None, (case.id, out.text)
    assert judged >= 2  # the others were refused (with a reason) or cut by max_tokens
