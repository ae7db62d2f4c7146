"""Heavy mask rows (a long counted repetition) filled on side threads, on the real default
model on the CPU: the same tokens as with those rows filled inline, overlapped and synchronous,
with and without mask shards, and with every heavy row late (the step samples without it and
the position runs again, reading the rows then); outputs valid. Heavy rows are xgrammar's: the
engines here keep the token-level DFA off (dfa_masks)."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from guided import LLM, SamplingParams
from guided.masks import side_fill
from guided.fsm.backends import xgrammar_backend
from guided.engine.overlap import OverlappedSteps
from guided.params import ConstraintSpec
from guided.worker import decode_steps
from guided.worker.model_runner import ModelRunner

NOTE = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16},
                                         "note": {"type": "string", "maxLength": 300},
                                         "stars": {"type": "integer"}},
        "required": ["title", "note", "stars"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def run(llm: LLM) -> list:
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Review book {i} as JSON "
                                         "with a title, a short note and stars."}])
               for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                             json_schema=NOTE if i % 2 else PERSON) for i in range(6)]
    return llm.generate(prompts, params)


@pytest.mark.parametrize("overlap,shards,late", [(True, 0, False), (False, 0, False),
                                                (True, 2, False), (True, 0, True)])
def test_side_threads_give_the_same_outputs(monkeypatch, overlap, shards, late):
    inline = LLM(num_kv_blocks=256, max_num_seqs=8, device="cpu", async_scheduling=overlap,
                 mask_processes=shards, dfa_masks=False)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(xgrammar_backend, "has_long_repetition", lambda compiled: False)
            want = run(inline)
            assert not inline.engine.step_times.counts.get("mask_rows_side")
    finally:
        inline.engine.shutdown()
    side = LLM(num_kv_blocks=256, max_num_seqs=8, device="cpu", async_scheduling=overlap,
               mask_processes=shards, dfa_masks=False)
    try:
        engine = side.engine
        if shards:
            assert engine._shards.wait_ready(120), "the mask shards did not start"
            run(side)  # ships the light grammar to the shards
        engine.step_times.reset()
        if late:  # the device never waits: a heavy row not filled at once is late
            monkeypatch.setattr(OverlappedSteps, "_late_rows_policy",
                                staticmethod(lambda launched: lambda: True))
        got = run(side)
        assert engine.step_times.counts["mask_rows_side"] > 0
        if late:
            assert engine.step_times.counts["late_rows"] > 0
        if shards:
            assert engine.step_times.counts["mask_rows_shards"] > 0
            assert not any(m.shard for m in engine._shards._mirrors.values())  # all released
        for a, b in zip(got, want):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        stopped = [(out, NOTE if i % 2 else PERSON) for i, out in enumerate(got)
                   if out.finish_reason == "stop"]
        assert any(schema is NOTE for _, schema in stopped), [o.text for o in got]
        for out, schema in stopped:
            jsonschema.validate(json.loads(out.text), schema)
        assert engine.stats().kv_blocks_in_use == 0
    finally:
        side.engine.shutdown()


class _DeviceDone:
    """A forward pass always finished: a multi-step call never waits for a heavy row."""

    @staticmethod
    def query() -> bool:
        return True


def built_dfas(engine) -> None:
    """The schemas' grammars compiled, and PERSON's DFA with its device tables built, as every
    request then finds them (a DFA's rows are the host's until its tables are in); NOTE's long
    string keeps it on xgrammar: its rows are the heavy ones."""
    for schema in (NOTE, PERSON):
        grammar = engine.compiler.submit(ConstraintSpec.json_schema(schema)).result()
        assert grammar.backend == ("xgrammar" if schema is NOTE else "dfa")
        dfa = getattr(grammar.matcher(), "dfa", None)
        if dfa is not None and dfa.tables_ready is not None:
            dfa.tables_ready.result(timeout=300)


@pytest.mark.parametrize("device,late,dfa", [
    ("cpu", False, False), ("cpu", True, False), ("cpu", False, True),
    # on a GPU the later steps of a call replay the decode graph on inputs the device advanced
    # (kernels/decode_inputs.py); with DFA rows the device also masks and steps those
    pytest.param("cuda", False, False, marks=pytest.mark.gpu),
    pytest.param("cuda", True, False, marks=pytest.mark.gpu),
    pytest.param("cuda", False, True, marks=pytest.mark.gpu)])
def test_multi_step_calls_give_heavy_rows_the_same_outputs(monkeypatch, device, late, dfa):
    """Multi-step decode over heavy and light rows: the tokens of one step at a time. Late:
    every heavy fill takes 10 ms and the device never waits, so a heavy row sits out each step
    where its fill is not in (the next step, or the next call, takes the kept fill): the
    device feeds it the same token at the same position again and its seeds follow its
    tokens, not the steps."""
    # jump-forward off in both: on a GPU its verify passes' logits differ from a decode
    # pass's by an ulp, enough to flip a sample at this temperature
    single = LLM(num_kv_blocks=256, max_num_seqs=8, device=device, async_scheduling=False,
                 jump_forward=False, dfa_masks=dfa)
    try:
        if dfa:
            built_dfas(single.engine)
        want = run(single)
    finally:
        single.engine.shutdown()
    multi = LLM(num_kv_blocks=256, max_num_seqs=8, device=device, num_scheduler_steps=4,
                jump_forward=False, dfa_masks=dfa)
    try:
        engine = multi.engine
        if dfa:
            built_dfas(engine)
        if late:
            slow_fill = side_fill.fill_draft_rows

            def fill_in_10_ms(*args, **kwargs):
                time.sleep(0.01)
                return slow_fill(*args, **kwargs)

            monkeypatch.setattr(side_fill, "fill_draft_rows", fill_in_10_ms)
            monkeypatch.setattr(ModelRunner, "_mark_forward_done", lambda self: _DeviceDone)
            # a batch this small would wait for its heavy rows (policy.waits_for_late_rows)
            monkeypatch.setattr(decode_steps, "waits_for_late_rows", lambda num_running: False)
        got = run(multi)
        assert engine.step_times.counts["multi_steps"] > 0
        if dfa:
            assert engine.step_times.counts.get("mask_rows_device", 0) > 0
        assert bool(engine.step_times.counts.get("late_steps")) is late
        for a, b in zip(got, want):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for i, out in enumerate(got):
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), NOTE if i % 2 else PERSON)
        assert engine.stats().kv_blocks_in_use == 0
    finally:
        multi.engine.shutdown()
