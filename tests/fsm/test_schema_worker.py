"""Schemas checked in worker processes (fsm/schema_worker.py): the same analysis and the same
refusals as in-process, a dead worker replaced with the schema checked in the asking thread,
and a compiler that uses them serving the same grammars."""
from __future__ import annotations

import json

import pytest

from guided.errors import ConstraintError
from guided.fsm.compiler import GrammarCompiler
from guided.fsm.schema_worker import SchemaWorkers, check
from guided.fsm.settings import CompileSettings
from guided.params import ConstraintSpec
from guided.worker.loader import load_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
# a bound on a non-integer number
BOUNDED = {"type": "object", "properties": {"x": {"type": "number", "minimum": 1.5}},
           "required": ["x"]}
# two patterns a key may both match, with different schemas
REFUSED = {"type": "object", "patternProperties": {"^a": {"type": "string"},
                                                   "a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def workers():
    pool = SchemaWorkers(2)
    yield pool
    pool.shutdown()


def test_workers_check_as_in_process(workers):
    for schema in (PERSON, BOUNDED, True):
        value = json.dumps(schema)
        assert workers.check(value) == check(value)


def test_workers_refuse_as_in_process(workers):
    with pytest.raises(ConstraintError) as in_process:
        check(json.dumps(REFUSED))
    with pytest.raises(ConstraintError) as in_worker:
        workers.check(json.dumps(REFUSED))
    assert str(in_worker.value) == str(in_process.value)
    assert "patternProperties" in str(in_worker.value)


def test_a_dead_worker_is_replaced():
    pool = SchemaWorkers(1)
    try:
        value = json.dumps(PERSON)
        want = check(value)
        assert pool.check(value) == want
        (worker,) = pool._all
        worker.kill()
        worker.wait()
        assert pool.check(value) == want  # answered by a new worker
        assert len(pool._all) == 2 and pool._all[1].poll() is None
    finally:
        pool.shutdown()


def test_compiler_with_schema_processes_serves_the_same_grammars():
    tokenizer = load_tokenizer("default")
    compilers = [GrammarCompiler(tokenizer, vocab_size=len(tokenizer),
                                 config=CompileSettings(schema_processes=n))
                 for n in (0, 1)]
    try:
        for schema, backend in ((PERSON, "xgrammar"), (BOUNDED, "xgrammar")):
            spec = ConstraintSpec.json_schema(schema)
            assert [c.compile(spec, timeout=120).backend for c in compilers] == [backend] * 2
        errors = []
        for c in compilers:
            with pytest.raises(ConstraintError) as e:
                c.compile(ConstraintSpec.json_schema(REFUSED), timeout=120)
            errors.append(str(e.value))
        assert errors[0] == errors[1]
    finally:
        for c in compilers:
            c.shutdown()
