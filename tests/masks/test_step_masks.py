"""masks/step_masks.py: a step's rows in the order build_output numbered them, each equal to
the matcher's own row after the drafts before it, rows that will be dropped allowing all."""
from __future__ import annotations

import pytest
import torch

from guided.fsm.compiler import GrammarCompiler
from guided.masks.step_masks import fill_step_masks
from guided.params import ConstraintSpec, SamplingParams
from guided.scheduler.output import build_output
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import ScheduledRequest, StepPlan
from guided.worker.step_times import StepTimes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                            "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer))
    yield c
    c.shutdown()


def _request(rid: str, compiler, spec: ConstraintSpec | None, block: int) -> Request:
    request = Request(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                      seed=0, eos_token_ids=(2,), max_tokens=32, status=RequestStatus.RUNNING)
    request.block_ids = [block]
    if spec is not None:
        request.matcher = compiler.compile(spec).matcher()
    return request


def test_rows_follow_the_numbering_of_build_output(compiler, tokenizer):
    words = -(-len(tokenizer) // 32)
    drafts = tokenizer.encode('{"name": "', add_special_tokens=False)
    plain = _request("plain", compiler, None, 0)
    json_a = _request("a", compiler, ConstraintSpec.json_schema(SCHEMA), 1)
    json_b = _request("b", compiler, ConstraintSpec.json_schema(SCHEMA), 2)
    plan = StepPlan(scheduled=[
        ScheduledRequest(plain, num_new_tokens=3, num_draft_tokens=0, sample=True),
        ScheduledRequest(json_a, num_new_tokens=3, num_draft_tokens=len(drafts), sample=True,
                         draft_token_ids=drafts),
        ScheduledRequest(json_b, num_new_tokens=3, num_draft_tokens=0, sample=True)])
    out, rows = build_output(plan, block_size=16)
    assert out.mask_rows == [-1, *range(len(drafts) + 2)]
    filled = fill_step_masks(plan, torch.zeros(len(drafts) + 2, words, dtype=torch.int32),
                             out.mask_rows, times=StepTimes())
    masks = filled.masks
    assert filled.failed == []
    assert masks.mask_rows == out.mask_rows and masks.bitmask.shape[0] == len(drafts) + 2
    # each of a's rows is its matcher's row after the drafts before it; the matcher is left
    # at its committed tokens
    for j in range(len(drafts) + 1):
        probe = compiler.compile(ConstraintSpec.json_schema(SCHEMA)).matcher()
        assert all(probe.accept_token(t) for t in drafts[:j])
        allowed = masks.bitmask[j]
        bits = (allowed.unsqueeze(-1) >> torch.arange(32)) & 1
        ids = set(torch.nonzero(bits.flatten()).flatten().tolist())
        if j < len(drafts):
            assert drafts[j] in ids
        want = torch.zeros(1, words, dtype=torch.int32)
        probe.fill_bitmask(want, 0)
        assert ids <= set(torch.nonzero(((want[0].unsqueeze(-1) >> torch.arange(32)) & 1)
                                        .flatten()).flatten().tolist())
    assert json_a.matcher.accept_token(drafts[0])  # still at the start
    # b's one row is its own start row, the same as a's first
    assert torch.equal(masks.bitmask[len(drafts) + 1], masks.bitmask[0])


def test_rows_of_finished_and_voided_entries_allow_everything(compiler, tokenizer):
    words = -(-len(tokenizer) // 32)
    done = _request("done", compiler, ConstraintSpec.json_schema(SCHEMA), 0)
    voided = _request("voided", compiler, ConstraintSpec.json_schema(SCHEMA), 1)
    done.status = RequestStatus.FINISHED
    item = ScheduledRequest(voided, num_new_tokens=1, num_draft_tokens=0, sample=True)
    item.voided = True
    plan = StepPlan(scheduled=[
        ScheduledRequest(done, num_new_tokens=1, num_draft_tokens=0, sample=True), item])
    out, _ = build_output(plan, block_size=16)
    masks = fill_step_masks(plan, torch.zeros(2, words, dtype=torch.int32), out.mask_rows,
                            times=StepTimes()).masks
    assert bool((masks.bitmask == -1).all())


def test_a_draft_the_grammar_rejects_is_cut_and_fails_nothing(compiler, tokenizer):
    words = -(-len(tokenizer) // 32)
    good = _request("good", compiler, ConstraintSpec.json_schema(SCHEMA), 0)
    bad = _request("bad", compiler, ConstraintSpec.json_schema(SCHEMA), 1)
    wrong = tokenizer.encode("xyz", add_special_tokens=False)
    plan = StepPlan(scheduled=[
        ScheduledRequest(good, num_new_tokens=1, num_draft_tokens=0, sample=True),
        ScheduledRequest(bad, num_new_tokens=1, num_draft_tokens=len(wrong), sample=True,
                         draft_token_ids=wrong)])
    out, _ = build_output(plan, block_size=16)
    times = StepTimes()
    filled = fill_step_masks(plan, torch.zeros(len(wrong) + 2, words, dtype=torch.int32),
                             out.mask_rows, times=times)
    assert filled.failed == [] and times.counts["drafts_cut"] == 1
    start = tokenizer.encode("{", add_special_tokens=False)[0]
    first_bad = filled.masks.bitmask[1]  # its first row: the grammar's, forbidding the draft
    assert (int(first_bad[start >> 5]) >> (start & 31)) & 1
    assert not (int(first_bad[wrong[0] >> 5]) >> (wrong[0] & 31)) & 1
    assert bool((filled.masks.bitmask[2:] == -1).all())  # past the cut: never kept
    assert torch.equal(filled.masks.bitmask[0], first_bad)  # the good request's row, its own
