"""The engine with mask shard processes, on the real default model on the CPU: the same tokens
as with every mask row filled in-process, overlapped and synchronous, schemas valid."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from guided import LLM, SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": [
                                               "kind", "brave", "tall"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CODE = r"[A-Z]{2}-[0-9]{3,5}"


def prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe person {i} as "
                                      "JSON with name, age and tags."}]) for i in range(n)]


def params() -> list[SamplingParams]:
    out = [SamplingParams(temperature=0.8, seed=i, max_tokens=60, json_schema=PERSON)
           for i in range(5)]
    return out + [SamplingParams(temperature=0.7, seed=9, max_tokens=12, regex=CODE),
                  SamplingParams(temperature=0.9, seed=3, max_tokens=16)]  # free text


@pytest.mark.parametrize("overlap", [True, False])
def test_shards_give_the_same_outputs_as_in_process_masks(overlap):
    plain = LLM(num_kv_blocks=256, max_num_seqs=8, device="cpu", mask_processes=0,
                async_scheduling=overlap)
    sharded = LLM(num_kv_blocks=256, max_num_seqs=8, device="cpu", mask_processes=2,
                  async_scheduling=overlap)
    try:
        engine = sharded.engine
        assert engine._shards.wait_ready(120), "the mask shards did not start"
        ps = prompts(plain, 7)
        want = plain.generate(ps, params())
        sharded.generate(ps, params())  # ships the grammars to the shards
        engine.step_times.reset()
        got = sharded.generate(ps, params())
        assert engine.step_times.counts["mask_rows_shards"] > 0
        assert engine.step_times.counts["drafts_shards"] > 0  # walked in the shards
        busy = engine.step_times.seconds  # the busiest shard's time a message, for benchmarks
        assert busy["shards: fill, busiest (part)"] > 0 < busy["shards: drafts, busiest (part)"]
        for a, b in zip(got, want):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for out in got[:5]:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), PERSON)
        assert got[5].finish_reason == "stop"
        assert re.fullmatch(CODE, got[5].text)
        assert engine.stats().kv_blocks_in_use == 0
        assert sum(s.num_mirrors for s in engine._shards._shards) == 0  # all released
    finally:
        plain.engine.shutdown()
        sharded.engine.shutdown()


def test_no_shards_by_default_off_the_gpu_even_when_overlapped(monkeypatch):
    import guided.engine.core

    monkeypatch.setattr(guided.engine.core, "NUM_CPUS", 64)  # a roomy host: only the device decides
    llm = LLM(num_kv_blocks=64, max_num_seqs=2, device="cpu", async_scheduling=True)
    try:
        assert llm.engine.overlap and llm.engine.mask_processes == 0
        assert llm.engine._shards is None
    finally:
        llm.engine.shutdown()
