"""DecodeStepMasks: the constrained rows of a multi-step decode call (guided/fsm/decode_masks.py)."""
from __future__ import annotations

import torch

from guided.fsm.decode_masks import DecodeStepMasks
from guided.params import ConstraintSpec, SamplingParams
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest, SchedulerOutput

WORDS = (49152 + 31) // 32


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def batch(compiler, tokenizer, regexes: list[str | None]) -> tuple[SchedulerOutput, list[int]]:
    """One decode entry a regex (None: unconstrained); the mask rows prepare would give."""
    sched, rows, next_row = SchedulerOutput(), [], 0
    for i, regex in enumerate(regexes):
        request = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8), seed=i,
                          eos_token_ids=(tokenizer.eos_token_id,), max_tokens=8)
        if regex is not None:
            request.matcher = request.draft_matcher = compiler.compile(
                ConstraintSpec("regex", regex)).matcher()
            rows.append(next_row)
            next_row += 1
        else:
            rows.append(-1)
        sched.scheduled.append(ScheduledRequest(request, 1, 0, True))
    return sched, rows


def token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_steps_walk_the_matchers_and_fill_their_rows(compiler, tokenizer):
    sched, rows = batch(compiler, tokenizer, ["ab(c|d)", None, "x+"])
    masks = DecodeStepMasks(sched, rows, num_threads=1)
    assert masks.num_rows == 2
    a, b, c, x = (token(tokenizer, t) for t in ("a", "b", "c", "x"))
    eos = tokenizer.eos_token_id
    bitmask = torch.zeros(2, WORDS, dtype=torch.int32)
    masks.fill(None, bitmask)  # the first step: the matchers as they are
    assert allowed(bitmask, 0, a) and not allowed(bitmask, 0, b)
    assert allowed(bitmask, 1, x) and not allowed(bitmask, 1, eos)
    masks.fill([a, 999, x], bitmask)  # the unconstrained row's token is nobody's business
    assert allowed(bitmask, 0, b) and not allowed(bitmask, 0, a)
    assert allowed(bitmask, 1, x) and allowed(bitmask, 1, eos)
    masks.accept([b, 5, eos])  # the last step's tokens, once the call is done
    assert masks.accepted_rows == frozenset({0, 2})
    first, third = sched.scheduled[0].request.matcher, sched.scheduled[2].request.matcher
    assert third.is_terminated()
    masks.fill(None, bitmask)  # an ended grammar's row allows everything: its tokens drop
    assert int(bitmask[1].eq(-1).all()) and allowed(bitmask, 0, c)
    assert first.accept_token(c) and not first.is_terminated()


def test_a_refused_token_walks_the_row_back_for_the_update(compiler, tokenizer):
    sched, rows = batch(compiler, tokenizer, ["ab", "ab"])
    masks = DecodeStepMasks(sched, rows, num_threads=1)
    a, b = token(tokenizer, "a"), token(tokenizer, "b")
    bitmask = torch.zeros(2, WORDS, dtype=torch.int32)
    masks.fill(None, bitmask)
    masks.fill([a, a], bitmask)
    masks.accept([b, a])  # row 1: "aa" is outside the grammar
    assert masks.accepted_rows == frozenset({0})
    refused = sched.scheduled[1].request
    assert refused.accept_committed(a) and refused.accept_committed(b), \
        "walked back to where the call began: the update feeds it again and finds the refusal"
    masks.fill([a, a], bitmask)  # a refused row takes nothing more and allows everything
    assert int(bitmask[1].eq(-1).all())


def test_a_late_heavy_row_sits_out_the_step_and_its_fill_is_kept(compiler, tokenizer,
                                                                  monkeypatch):
    """A heavy row not filled when the device is done is late: it allows every token, its
    sample of the step is not taken, and its fill (kept on the request, its matcher
    untouched) serves the next step, or the next call, at the same state."""
    from concurrent.futures import Future

    from guided.masks import side_fill
    from guided.masks.side_fill import SideFill

    sched, rows = batch(compiler, tokenizer, ["ab(c|d)", "x+"])
    heavy = sched.scheduled[1].request
    heavy.matcher.heavy = True
    started: list[SideFill] = []

    def held_fill(matcher, drafts, num_tokens, words, *, num_threads):
        fill = SideFill(Future(), num_tokens, tuple(drafts))
        started.append(fill)
        return fill

    monkeypatch.setattr(side_fill, "start_side_fill", held_fill)
    a, x = token(tokenizer, "a"), token(tokenizer, "x")
    bitmask = torch.zeros(2, WORDS, dtype=torch.int32)
    masks = DecodeStepMasks(sched, rows, num_threads=1)
    assert masks.fill(None, bitmask, give_up=lambda: True) == {1}  # the device is done
    assert int(bitmask[1].eq(-1).all())
    assert heavy.side_fill is started[0]  # kept on the request, its matcher untouched
    # step 2: its step-1 sample (a stray "a") is not taken; still late, the same fill
    assert masks.fill([a, a], bitmask, give_up=lambda: True) == {1}
    assert len(started) == 1

    filled = torch.zeros(1, WORDS, dtype=torch.int32)
    filled[0, x // 32] = 1 << (x % 32)
    started[0].future.set_result(filled)
    # step 3: the kept fill is in: the row takes part, with that fill's row
    assert masks.fill([token(tokenizer, "b"), a], bitmask, give_up=lambda: True) == set()
    assert heavy.side_fill is None and len(started) == 1
    assert torch.equal(bitmask[1], filled[0])
    masks.accept([token(tokenizer, "c"), x])
    assert masks.accepted_rows == frozenset({0, 1}), "a stray sample fed to x+ is refused"
