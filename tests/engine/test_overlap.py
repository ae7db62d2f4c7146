"""Overlapped scheduling (async_scheduling) with the real default model on the CPU: the host
updates step t and prepares t+2 while t+1 is in flight, so these tests pin down that nothing a
user sees changes: tokens, texts, finish reasons, schema validity, aborts, preemption, blocks.
On the CPU (fp32): exact equality needs numerics that do not change with the batch's shape,
which bf16 on a GPU does not promise."""
from __future__ import annotations

import json

import jsonschema
import pytest

from guided import LLM, SamplingParams
from guided.scheduler import policy

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def pair():
    sync = LLM(num_kv_blocks=128, max_num_seqs=8, async_scheduling=False, device="cpu")
    overlap = LLM(num_kv_blocks=128, max_num_seqs=8, async_scheduling=True, device="cpu")
    yield sync, overlap
    sync.engine.shutdown()
    overlap.engine.shutdown()


def prompts(llm: LLM, n: int) -> list[list[int]]:
    topics = ["a person", "a city", "a dragon", "the sea", "a robot", "tea"]
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe {topics[i % 6]} "
                                      f"as JSON, item {i}."}]) for i in range(n)]


def test_overlap_gives_the_same_outputs_as_synchronous_steps(pair):
    sync, overlap = pair
    assert overlap.engine.depth == 1 and sync.engine.depth == 0
    first = sync.generate(prompts(sync, 5)[4], SamplingParams(temperature=0, max_tokens=16))[0]
    stop_word = first.text.split()[3]
    params = [SamplingParams(temperature=0, max_tokens=48, json_schema=PERSON),
              SamplingParams(temperature=0.8, seed=5, max_tokens=48, json_schema=PERSON),
              SamplingParams(temperature=0, max_tokens=30, json_schema=FLAG),
              SamplingParams(temperature=0.9, seed=3, max_tokens=25),  # free text
              SamplingParams(temperature=0, max_tokens=40, stop=[stop_word]),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=300)]  # stops at EOS
    ps = prompts(sync, len(params))
    want = sync.generate(ps, params)
    got = overlap.generate(ps, params)
    for a, b in zip(got, want):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert [e.token_id for e in got[5].logprobs] == got[5].token_ids
    assert [round(e.logprob, 4) for e in got[5].logprobs] == [
        round(e.logprob, 4) for e in want[5].logprobs]
    for out in got[:3]:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), params[got.index(out)].json_schema)
    assert got[4].finish_reason == "stop" and stop_word not in got[4].text
    assert overlap.engine.stats().kv_blocks_in_use == 0
    # forced text was drafted and verified under overlap too
    assert overlap.engine.stats().jump_forward_tokens_total > 0


def test_drafts_anchored_on_the_in_flight_sample_keep_outputs_and_save_passes(pair):
    """Under overlap a constrained request drafts every step: forced text (and prompt lookup)
    after its in-flight sample, anchored on a guess of that sample. Hits, misses and voided
    entries (a draft of the step before was rejected) must all leave the outputs unchanged."""
    sync, overlap = pair
    ps = prompts(sync, 8)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=80,
                             json_schema=PERSON) for i in range(8)]
    want = sync.generate(ps, params)
    overlap.engine.step_times.reset()
    got = overlap.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out, p in zip(got, params):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), p.json_schema)
    counts = overlap.engine.step_times.counts
    assert counts["anchor_hits"] > 0 and counts["anchor_misses"] + counts["voided_rows"] > 0
    # fewer forward passes per request than tokens: drafts were verified while overlapping
    assert sum(o.metrics.forward_passes for o in got) < 0.8 * sum(len(o.token_ids) for o in got)
    assert overlap.engine.stats().kv_blocks_in_use == 0


def test_anchoring_held_back_while_it_does_not_pay_keeps_outputs(pair):
    """An engine whose anchored proposals gain too little anchors only one in probe_every:
    far fewer anchored entries, the same outputs."""
    sync, overlap = pair
    ps = prompts(sync, 6)
    params = [SamplingParams(temperature=0, max_tokens=60, json_schema=PERSON)] * 6
    want = sync.generate(ps, params)
    engine = overlap.engine
    engine.step_times.reset()
    assert [o.token_ids for o in overlap.generate(ps, params)] == [o.token_ids for o in want]
    anchored = engine.step_times.counts["anchor_hits"] + engine.step_times.counts["anchor_misses"]
    payoff = engine.anchor_payoff
    bar, gain, asked = payoff.min_gain, payoff.mean_gain, payoff.num_asked
    try:
        payoff.min_gain, payoff.num_asked = gain + 100, 0  # nothing pays
        engine.step_times.reset()
        got = overlap.generate(ps, params)
        counts = engine.step_times.counts
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        # about one asked in probe_every is anchored (at random), far fewer than before
        held_back = counts["anchor_hits"] + counts["anchor_misses"]
        assert held_back <= payoff.num_asked // 3 and held_back < anchored
    finally:
        payoff.min_gain, payoff.mean_gain, payoff.num_asked = bar, gain, asked


def test_overlap_survives_aborts_and_preemption_without_leaking_blocks(monkeypatch):
    monkeypatch.setattr(policy, "ADMISSION_LOOKAHEAD_TOKENS", 0)  # admit greedily: preempt
    llm = LLM(num_kv_blocks=8, max_num_seqs=8, enable_prefix_caching=False,
              async_scheduling=True, device="cpu")
    reference = LLM(num_kv_blocks=64, max_num_seqs=8, async_scheduling=False, device="cpu")
    try:
        engine = llm.engine
        ps = prompts(llm, 6)
        params = [SamplingParams(max_tokens=30 + 4 * i, temperature=0,
                                 json_schema=PERSON if i % 2 else None, ignore_eos=not i % 2)
                  for i in range(6)]
        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(f"r{i}", p, sp)
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps == 4:
                engine.abort_request("r1")  # running, with a step in flight
                engine.abort_request("r5")  # still waiting
        assert set(finished) == {f"r{i}" for i in range(6)}
        assert engine.stats().preemptions_total > 0
        assert finished["r1"].finish_reason == finished["r5"].finish_reason == "abort"
        # preempted requests (their in-flight tokens kept, their cache recomputed) end up
        # with exactly the tokens of an undisturbed run
        for i in (0, 2, 3, 4):
            want = reference.generate(ps[i], params[i])[0]
            assert finished[f"r{i}"].token_ids == want.token_ids
        assert engine.stats().kv_blocks_in_use == 0
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert all(b.ref_count == 0 for b in bm.blocks)
    finally:
        llm.engine.shutdown()
        reference.engine.shutdown()


def test_a_failed_overlapped_step_drops_the_pipeline_and_requests_recover(pair):
    _, overlap = pair
    engine = overlap.engine
    p = prompts(overlap, 1)[0]
    want = overlap.generate(p, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    engine.add_request("x", p, SamplingParams(temperature=0, max_tokens=12))
    for _ in range(4):
        engine.step()
    real_sample = engine.runner.sample

    def broken(*args, **kwargs):  # after the launched step was taken off the pipeline
        raise RuntimeError("device lost")

    engine.runner.sample = broken
    with pytest.raises(RuntimeError):
        engine.step()
    engine.runner.sample = real_sample
    done = None
    for _ in range(200):  # a request left counting a lost step would never finish
        for out in engine.step():
            if out.finished:
                done = out
        if not engine.has_unfinished_requests():
            break
    assert done is not None and done.token_ids == want
    assert engine.stats().kv_blocks_in_use == 0
