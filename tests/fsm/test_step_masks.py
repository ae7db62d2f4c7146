"""A step's mask rows (guided/fsm/step_masks.py) with lazy masks: a lazy row inside a JSON string
allows exactly what the string ban keeps, other lazy rows what the JSON ban keeps, and the
filled rows are the grammar's own."""
from __future__ import annotations

import numpy as np
import torch

from guided.fsm.lazy_masks import OUTSIDE, note_json_token
from guided.fsm.step_masks import fill_step_masks
from guided.params import SamplingParams
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from guided.step_times import StepTimes

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _request(compiler, i: int, text: bytes, *, wide: bool) -> Request:
    params = SamplingParams(json_schema=SCHEMA)
    request = Request(request_id=f"r{i}", prompt_token_ids=[1], params=params, seed=0,
                      eos_token_ids=(), max_tokens=64)
    request.matcher = compiler.compile(params.constraint).matcher()
    request.json_string = OUTSIDE
    assert request.matcher.accept_bytes(text)
    note_json_token(request, text)
    request.mask_wide = wide
    return request


def test_lazy_rows_keep_what_their_ban_keeps(compiler):
    requests = [_request(compiler, 0, b'{"name": "Jo', wide=True),  # in a string: string ban
                _request(compiler, 1, b'{"name": "Jo\\', wide=True),  # after \: JSON ban
                _request(compiler, 2, b'{"name": "Jo', wide=False)]  # filled from its grammar
    sched = SchedulerOutput([ScheduledRequest(r, 1, 0, True) for r in requests])
    width = -(-compiler.vocab.vocab_size // 32)
    bitmask = torch.zeros((3, width), dtype=torch.int32)
    bans = fill_step_masks(sched, bitmask, num_threads=1, times=StepTimes(),
                           lazy_min_allowed=0.5)
    assert [item.lazy_mask for item in sched.scheduled] == [True, True, False]
    matcher = requests[0].matcher
    assert np.array_equal(bitmask[0].numpy(), matcher.string_ban.keep_words.numpy())
    assert np.array_equal(bitmask[1].numpy(), matcher.ban.keep_words.numpy())
    expected = torch.zeros((1, width), dtype=torch.int32)
    requests[2].matcher.fill_bitmask(expected, 0)
    keep = matcher.ban.keep_words
    for ban, rows in bans.values():  # the filled row's ban may be left to the device
        assert rows == [2]
        keep = ban.keep_words
    assert np.array_equal(bitmask[2].numpy() & keep.numpy(), expected[0].numpy() & keep.numpy())
    # the string ban keeps a strict subset of the JSON ban's tokens, and far from all
    string_kept = np.unpackbits(bitmask[0].numpy().view(np.uint8)).sum()
    json_kept = np.unpackbits(bitmask[1].numpy().view(np.uint8)).sum()
    assert json_kept - 100 > string_kept > 0.9 * json_kept
