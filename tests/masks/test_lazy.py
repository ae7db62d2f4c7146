"""Lazy masks with the real default model on the CPU: a constrained request whose last mask
row allowed most of the vocabulary samples its next rows unmasked, and the host checks the
tokens against the grammar; a token outside it sends the request back one position, masked.
Outputs must not change (Gumbel-max on the same noise: an allowed unmasked argmax is the
masked one), in synchronous and overlapped steps, greedy and seeded sampling alike."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from guided import LLM, SamplingParams
from guided.errors import InvalidRequestError
from guided.masks.lazy import (
    ESCAPED,
    INSIDE,
    OUTSIDE,
    LazyGate,
    accept_unmasked_row,
    json_string_state,
    mark_wide,
    note_json_token,
)
from guided.scheduler.request import Request
from guided.engine.step_times import StepTimes

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "bio": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "bio", "age"]}


@pytest.fixture(scope="module")
def engines():
    # lazy rows are xgrammar's (a DFA's rows cost a copy and are never sampled lazily)
    common = {"num_kv_blocks": 160, "max_num_seqs": 8, "device": "cpu", "dfa_masks": False}
    eager = LLM(async_scheduling=False, lazy_masks=False, **common)
    # every request unmasked after its first filled row, however narrow: many misses
    # with candidates: a sample outside is mostly replaced by the first allowed candidate
    lazy_sync = LLM(async_scheduling=False, lazy_masks=True, lazy_mask_min_allowed=0.0,
                    lazy_mask_candidates=8, **common)
    lazy_overlap = LLM(async_scheduling=True, lazy_mask_min_allowed=0.0, lazy_mask_candidates=8,
                       **common)
    yield eager, lazy_sync, lazy_overlap
    for llm in (eager, lazy_sync, lazy_overlap):
        llm.engine.shutdown()


def prompts(llm: LLM, n: int) -> list[list[int]]:
    topics = ["a person", "a painter", "a sailor", "a chef", "a robot", "a child"]
    return [llm.apply_chat_template([{"role": "user", "content": f"Describe {topics[i % 6]} "
                                      f"as JSON, with a short bio. Item {i}."}])
            for i in range(n)]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=60, json_schema=PERSON),
            SamplingParams(temperature=0.8, seed=7, max_tokens=60, json_schema=PERSON),
            SamplingParams(temperature=0.7, seed=2, max_tokens=40, regex=r"[A-Z][a-z]+ \d{2}"),
            SamplingParams(temperature=0, max_tokens=10, choice=["red", "green", "blue"]),
            SamplingParams(temperature=0, max_tokens=50, json_schema=PERSON, logprobs=2),
            # top-p cuts the masked distribution: never sampled unmasked
            SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=50, json_schema=PERSON),
            SamplingParams(temperature=0, max_tokens=30)]  # free text alongside


def check_valid(outputs, params) -> None:
    for out, p in zip(outputs, params):
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason != "stop":
            continue
        if p.json_schema is not None:
            jsonschema.validate(json.loads(out.text), p.json_schema)
        elif p.regex is not None:
            assert re.fullmatch(p.regex, out.text)
        elif p.choice is not None:
            assert out.text in p.choice


@pytest.mark.parametrize("which", ["sync", "overlap"])
def test_lazy_masks_keep_outputs_and_recover_from_misses(engines, which):
    eager, lazy_sync, lazy_overlap = engines
    lazy = lazy_sync if which == "sync" else lazy_overlap
    params = mixed_params()
    ps = prompts(eager, len(params))
    want = eager.generate(ps, params)
    lazy.engine.step_times.reset()
    got = lazy.generate(ps, params)
    for a, b in zip(got, want):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    # a position sampled again runs in another batch: fp32 sums in another order
    assert [e.logprob for e in got[4].logprobs] == pytest.approx(
        [e.logprob for e in want[4].logprobs], abs=1e-3)
    check_valid(got, params)
    counts = lazy.engine.step_times.counts
    # rows went unmasked; some samples fell outside the grammar: most were replaced by one of
    # their candidates, the rest (no candidate allowed: narrow rows) sampled again
    assert counts["mask_rows_lazy"] > 0 and counts["lazy_replaced"] > 0
    assert counts["lazy_misses"] > 0
    assert lazy.engine.stats().kv_blocks_in_use == 0


def test_wide_rows_only_at_the_default_bar(engines):
    """At the default bar (half the vocabulary) only rows inside strings go unmasked: far fewer
    misses per unmasked row than with every row unmasked, the same outputs."""
    eager, _, _ = engines
    lazy = LLM(num_kv_blocks=160, max_num_seqs=8, device="cpu", async_scheduling=True,
               dfa_masks=False)
    try:
        assert lazy.engine.lazy_masks and not eager.engine.lazy_masks
        params = [SamplingParams(temperature=0, max_tokens=80, json_schema=PERSON)] * 4
        ps = prompts(eager, 4)
        want = eager.generate(ps, params)
        got = lazy.generate(ps, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        check_valid(got, params)
        counts = lazy.engine.step_times.counts
        assert counts["mask_rows_lazy"] > 0
        assert counts["lazy_misses"] <= 0.25 * counts["mask_rows_lazy"]
        # inside strings they read the string ban's row (one a step, shared)
        assert 0 < counts["mask_rows_banned"] <= counts["mask_rows_lazy"]
    finally:
        lazy.engine.shutdown()


def test_mark_wide_measures_each_requests_last_row():
    words = 8  # 256 tokens
    bitmask = torch.zeros((3, words), dtype=torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1, :3] = -1  # 96 of 256
    bitmask[2, :5] = -1  # 160 of 256
    requests = [Request(f"r{i}", [1], SamplingParams(), 0, (), 8) for i in range(3)]
    requests[1].mask_wide = True  # cleared by a narrow row
    mark_wide(bitmask, [(r, i) for i, r in enumerate(requests)], 0.5)
    assert [r.mask_wide for r in requests] == [True, False, True]
    mark_wide(bitmask, [(requests[2], 2)], 0.7)
    assert requests[2].mask_wide is False
    assert np.all(bitmask.numpy()[0] == -1)  # read, not changed


def test_json_string_state_follows_quotes_and_escapes():
    state = OUTSIDE
    steps = [(b'{"', INSIDE), (b"name", INSIDE), (b'":', OUTSIDE), (b' "', INSIDE),
             (b"Al\\", ESCAPED), (b'"ice', INSIDE), (b"\\", ESCAPED), (b"\\", INSIDE),
             (b'\\"', INSIDE), (b'"}', OUTSIDE), (b"", OUTSIDE)]
    for text, want in steps:
        state = json_string_state(state, text)
        assert state == want, text
    assert json_string_state(ESCAPED, b"") == ESCAPED


def test_lazy_mask_min_allowed_is_a_share():
    from guided.config import EngineConfig

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidRequestError):
            EngineConfig(lazy_mask_min_allowed=bad)


def test_lazy_gate_turns_off_while_the_host_waits_on_the_device():
    times, gate = StepTimes(), LazyGate()

    def step(wait_ms: float, fill_ms: float) -> bool:
        times.seconds["sample_wait"] += wait_ms / 1e3
        times.seconds["mask_fill"] += fill_ms / 1e3
        return gate.observe(times)

    # host-bound (the default model): the fill is on the critical path
    assert all([step(0.05, 3.0) for _ in range(20)][1:])
    # device-bound (a large model): the fill hides behind the forward pass
    decisions = [step(3.0, 1.0) for _ in range(40)]
    assert decisions[0] and not decisions[-1]
    times.reset()  # a benchmark's reset: that look is skipped, not read as a negative step
    assert step(3.0, 1.0) is False and gate.wait_ms > 0


def test_lazy_gate_leaves_out_the_wait_for_heavy_rows():
    """A step gives up on heavy rows once the device would wait on them (late rows): the
    host's wait for them before that costs the device nothing, so it is no fill cost."""
    times, gate = StepTimes(), LazyGate()
    for _ in range(40):
        times.seconds["sample_wait"] += 3e-3
        times.seconds["mask_fill"] += 1e-3
        times.seconds["mask_wait"] += 5e-3
        times.seconds["mask_wait: side rows (part)"] += 4.5e-3
        on = gate.observe(times)
    assert not on and 1.2 < gate.fill_ms < 1.5  # a running mean of 1.5 ms, not 6


def test_a_token_that_closes_a_string_and_opens_the_next_ends_a_lazy_run():
    request = Request("r", [1], SamplingParams(), 0, (), 8)
    request.json_string, request.mask_wide = INSIDE, True
    note_json_token(request, b"ice")
    assert request.mask_wide and request.json_string == INSIDE
    note_json_token(request, b'", "')  # inside again, past two edges
    assert not request.mask_wide and request.json_string == INSIDE


class _Matcher:
    """Counts its tokens; rejects those in `rejects` (two matchers that disagree cannot be
    built from one grammar: this is the split accept_committed guards against)."""

    def __init__(self, rejects=()):
        self.tokens, self.rejects = [], set(rejects)

    def accept_token(self, token):
        if token in self.rejects:
            return False
        self.tokens.append(token)
        return True

    def rollback(self, n):
        del self.tokens[len(self.tokens) - n:]

    def ended_with(self, token):
        return token == 0  # the test's stop token


def test_accept_committed_leaves_both_matchers_in_step_when_one_rejects():
    request = Request("r", [1], SamplingParams(), 0, (), 8)
    request.matcher, request.draft_matcher = _Matcher(), _Matcher(rejects={7})
    assert request.accept_committed(5)
    assert not request.accept_committed(7)
    assert request.matcher.tokens == request.draft_matcher.tokens == [5]


def test_an_unmasked_row_takes_the_first_allowed_candidate_of_a_token_outside():
    def request(rejects):
        r = Request("r", [1], SamplingParams(), 0, (), 8)
        r.matcher = r.draft_matcher = _Matcher(rejects)
        return r

    # all stand
    r = request({9})
    row = accept_unmasked_row(r, [5, 6, 4], 3, {})
    assert (row.tokens, row.stand, row.missed, row.replaced) == ([5, 6, 4], 3, False, False)
    # the second token lies outside: its first allowed candidate takes its place, the token
    # after it (conditioned on the one replaced) does not stand
    r = request({9, 3})
    row = accept_unmasked_row(r, [5, 9, 4], 3, {1: [9, 3, 8, 2]})
    assert (row.tokens[:row.stand], row.missed, row.replaced) == ([5, 8], False, True)
    assert r.matcher.tokens == [5, 8]
    # no candidate allowed (or none at all): a miss, the matcher holds what stood before it
    for candidates in ({1: [9, 3]}, {}, None):
        r = request({9, 3})
        row = accept_unmasked_row(r, [5, 9, 4], 3, candidates)
        assert (row.stand, row.missed, row.replaced) == (1, True, False)
        assert r.matcher.tokens == [5]
    # a token that ends the grammar: nothing after it is fed
    r = request(set())
    row = accept_unmasked_row(r, [5, 0, 4], 3, {})
    assert row.stand == 2 and r.matcher.tokens == [5, 0]
