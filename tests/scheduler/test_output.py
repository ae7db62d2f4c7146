"""scheduler/output.py build_output: a step's tokens, positions and KV slots as plain data."""
from __future__ import annotations

from guided.params import SamplingParams
from guided.scheduler.output import build_output
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import ScheduledRequest, StepPlan

BS = 4


def _request(rid: str, prompt_len: int, output: list[int], blocks: list[int],
             computed: int) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[1000 + i for i in range(prompt_len)],
                params=SamplingParams(), seed=0, eos_token_ids=(2,), max_tokens=64,
                status=RequestStatus.RUNNING)
    r.output_token_ids = list(output)
    r.block_ids = blocks
    r.num_computed_tokens = computed
    return r


def test_tokens_and_slots_of_chunks_that_start_and_end_mid_block():
    # a prompt's middle chunk (from mid-block, across scattered blocks), a chunk that runs from
    # the prompt into the output, a decode, and drafts after the last known token
    middle = _request("middle", 20, [], [9, 3, 7, 1, 5], computed=3)
    across = _request("across", 6, [60, 61, 62], [4, 8, 2], computed=5)
    decode = _request("decode", 5, [70], [6, 0], computed=5)
    drafts = _request("drafts", 3, [80], [11, 12], computed=3)
    plan = StepPlan(scheduled=[
        ScheduledRequest(middle, num_new_tokens=13, num_draft_tokens=0, sample=False),
        ScheduledRequest(across, num_new_tokens=4, num_draft_tokens=0, sample=True),
        ScheduledRequest(decode, num_new_tokens=1, num_draft_tokens=0, sample=True),
        ScheduledRequest(drafts, num_new_tokens=1, num_draft_tokens=2, sample=True,
                         draft_token_ids=[81, 82])])
    out, _ = build_output(plan, block_size=BS)
    want_ids, want_slots = [], []
    for item in plan.scheduled:
        r = item.request
        known = r.prompt_token_ids + r.output_token_ids + item.draft_token_ids
        for pos in range(r.num_computed_tokens,
                         r.num_computed_tokens + item.num_new_tokens + item.num_draft_tokens):
            want_ids.append(known[pos])
            want_slots.append(r.block_ids[pos // BS] * BS + pos % BS)
    assert out.input_ids == want_ids
    assert out.slot_mapping == want_slots
    assert out.positions == [*range(3, 16), *range(5, 9), 5, *range(3, 6)]
    assert out.query_start_loc == [0, 13, 17, 18, 21]
    assert out.seq_lens == [16, 9, 6, 6]


def test_prompt_spans_cover_the_prompt_positions_of_the_rows_that_ask():
    # a first chunk, a last chunk (its last prompt position samples: no span for it), a chunk
    # recomputed after a preemption once all are held (none), and a request that does not ask
    first = _request("first", 10, [], [1, 2, 3], computed=0)
    last = _request("last", 10, [], [4, 5, 6], computed=6)
    held = _request("held", 3, [50], [7], computed=0)
    plain = _request("plain", 8, [], [8, 9], computed=0)
    for r, entries in ((first, [None]), (last, [None] * 6), (held, [None] * 3)):
        r.params = SamplingParams(prompt_logprobs=2)
        r.prompt_logprobs = entries
    plan = StepPlan(scheduled=[
        ScheduledRequest(first, num_new_tokens=6, num_draft_tokens=0, sample=False),
        ScheduledRequest(last, num_new_tokens=4, num_draft_tokens=0, sample=True),
        ScheduledRequest(held, num_new_tokens=4, num_draft_tokens=0, sample=True),
        ScheduledRequest(plain, num_new_tokens=8, num_draft_tokens=0, sample=True)])
    out, rows = build_output(plan, block_size=BS)
    assert [(s.token_start, s.target_ids, s.num_top) for s in out.prompt_spans] == [
        (0, [1001, 1002, 1003, 1004, 1005, 1006], 2), (6, [1007, 1008, 1009], 2)]
    assert rows.prompt_owner == [0, 1] and rows.prompt_first == [1, 7]
    assert not build_output(StepPlan(scheduled=plan.scheduled[2:]), block_size=BS)[0].prompt_spans
