"""Mask shards: rows filled by shard processes from mirror matchers equal the rows the engine
fills in-process (token bans included), a rejected draft is reported as in-process, each last
row's allowed tokens come back counted, and a shard that dies costs nothing but its speed (its
rows are filled in-process)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from guided.fsm.backends.xgrammar_backend import Recipe, token_ban
from guided.masks.bitmask_fill import allowed_counts, fill_draft_rows
from guided.fsm.mask_shards import MaskShards
from guided.params import ConstraintSpec
from guided.worker.host_bitmasks import HostBitmasks

VOCAB = 49152
WORDS = VOCAB // 32
SCHEMA = ConstraintSpec.json_schema({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "tags": {"type": "array", "items": {"enum": ["a", "bc"]}}},
    "required": ["name", "tags"], "additionalProperties": False})
REGEX = ConstraintSpec("regex", r"[a-z]{1,8}-[0-9]{2,6}")


@pytest.fixture()
def shards(compiler):
    s = MaskShards(compiler.xgrammar_tokenizer_info, 2)
    assert s.wait_ready(120), "the shards did not start"
    yield s
    s.shutdown()


@pytest.fixture()
def buffer():
    host = HostBitmasks(WORDS, torch.device("cpu"), shared=True)
    yield host
    host.release()


def request(compiler, tokenizer, spec, request_id: str, text: str) -> SimpleNamespace:
    matcher = compiler.compile(spec, timeout=60).matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        assert matcher.accept_token(token)
    return SimpleNamespace(request_id=request_id, matcher=matcher, output_token_ids=tokens,
                           prompt_token_ids=[])


def layout(requests, drafts_of) -> list[tuple]:
    entries, row = [], 0
    for r in requests:
        entries.append((r, drafts_of(r), row))
        row += len(drafts_of(r)) + 1
    return entries


def fill_until_remote(shards, entries, bitmask, segment):
    """Dispatch until every entry goes to a shard (grammars ship in the background); the rows
    of the last round, filled as the engine would (the rest in-process)."""
    deadline = time.monotonic() + 60
    while True:
        local, remote, pending = shards.dispatch(entries, segment)
        if local:
            fill_draft_rows(local, bitmask, num_threads=1)
        failed, error, counted = pending.wait() if pending else ([], None, {})
        assert not failed and error is None
        if not local:
            return remote, counted
        assert time.monotonic() < deadline, "grammars never reached the shards"
        time.sleep(0.02)


def test_shard_rows_equal_in_process_rows_as_tokens_are_committed(compiler, tokenizer, shards,
                                                                  buffer):
    requests = [request(compiler, tokenizer, SCHEMA, "j0", '{"name": "'),
                request(compiler, tokenizer, SCHEMA, "j1", '{"name": "ab", "tags": ['),
                request(compiler, tokenizer, REGEX, "r0", "abc")]
    drafts = {"j0": tokenizer.encode('xy", "tags": [', add_special_tokens=False),
              "j1": [], "r0": tokenizer.encode("-12", add_special_tokens=False)}
    entries = layout(requests, lambda r: drafts[r.request_id])
    rows = sum(len(d) + 1 for d in drafts.values())
    bitmask = buffer.take(rows)
    remote, counted = fill_until_remote(shards, entries, bitmask, buffer.segment_of(bitmask))
    assert len(remote) == 3
    expected = torch.empty(rows, WORDS, dtype=torch.int32)
    fill_draft_rows([(r.matcher, d, first) for r, d, first in entries], expected, num_threads=1)
    assert torch.equal(bitmask, expected)
    last_rows = [first + len(d) for _, d, first in entries]
    assert counted == dict(zip(last_rows, allowed_counts(expected, last_rows).tolist()))
    assert bitmask.ne(0).any(1).all()  # every row allows something: not left blank
    # tokens committed since: the mirrors catch up with the next fill
    for r, text in zip(requests, ['ab', '"a"', "de-4"]):
        for token in tokenizer.encode(text, add_special_tokens=False):
            assert r.matcher.accept_token(token)
            r.output_token_ids.append(token)
    entries = layout(requests, lambda r: [])
    bitmask = buffer.take(3)
    bitmask.zero_()
    local, remote, pending = shards.dispatch(entries, buffer.segment_of(bitmask))
    assert not local and pending.wait()[:2] == ([], None)
    expected = torch.empty(3, WORDS, dtype=torch.int32)
    fill_draft_rows([(r.matcher, [], i) for i, r in enumerate(requests)], expected,
                    num_threads=1)
    assert torch.equal(bitmask, expected)


def test_a_rejected_draft_is_reported_as_in_process(compiler, tokenizer, shards, buffer):
    r = request(compiler, tokenizer, REGEX, "r0", "abc")
    bitmask = buffer.take(2)
    fill_until_remote(shards, [(r, [], 0)], bitmask, buffer.segment_of(bitmask))
    bad = tokenizer.encode("!", add_special_tokens=False)
    local, remote, pending = shards.dispatch([(r, bad, 0)], buffer.segment_of(bitmask))
    assert remote and not local
    failed, error, _ = pending.wait()
    assert not failed and f"draft token {bad[0]} rejected" in error
    with pytest.raises(RuntimeError, match=f"draft token {bad[0]} rejected"):
        fill_draft_rows([(r.matcher, bad, 0)], torch.empty(2, WORDS, dtype=torch.int32),
                        num_threads=1)


def test_a_dead_shard_hands_its_rows_back(compiler, tokenizer, shards, buffer):
    requests = [request(compiler, tokenizer, SCHEMA, f"j{i}", '{"name": "') for i in range(4)]
    bitmask = buffer.take(4)
    segment = buffer.segment_of(bitmask)
    entries = layout(requests, lambda r: [])
    fill_until_remote(shards, entries, bitmask, segment)
    for shard in shards._shards:
        shard.process.kill()
        shard.process.wait()
    bitmask.zero_()
    local, remote, pending = shards.dispatch(entries, segment)
    failed = [] if pending is None else pending.wait()[0]
    fill_draft_rows(local + failed, bitmask, num_threads=1)
    assert len(local) + len(failed) == 4  # every row came back: filled in-process
    expected = torch.empty(4, WORDS, dtype=torch.int32)
    fill_draft_rows([(r.matcher, [], i) for i, r in enumerate(requests)], expected,
                    num_threads=1)
    assert torch.equal(bitmask, expected)
    local, remote, pending = shards.dispatch(entries, segment)  # from now on in-process
    assert len(local) == 4 and pending is None


def test_released_requests_leave_their_shard(compiler, tokenizer, shards, buffer):
    requests = [request(compiler, tokenizer, SCHEMA, f"j{i}", '{"name": "') for i in range(4)]
    bitmask = buffer.take(4)
    fill_until_remote(shards, layout(requests, lambda r: []), bitmask, buffer.segment_of(bitmask))
    assert sum(s.num_mirrors for s in shards._shards) == 4
    for r in requests:
        shards.release(r.request_id)
    assert sum(s.num_mirrors for s in shards._shards) == 0
    assert sorted(i for s in shards._shards for i in s.closes) == ["j0", "j1", "j2", "j3"]


def test_a_shard_ands_its_rows_ban_and_counts_them_before_it(compiler, tokenizer, shards,
                                                            buffer):
    banned = request(compiler, tokenizer, REGEX, "r0", "abc")
    plain = request(compiler, tokenizer, REGEX, "r1", "abc")  # the same rows, no ban
    drafts = tokenizer.encode("de", add_special_tokens=False)
    lowercase = [i for i in range(VOCAB) if tokenizer.decode([i]) in ("f", "g", "x", "-")]
    banned.matcher.ban = token_ban(frozenset(lowercase), VOCAB)
    entries = [(banned, drafts, 0), (plain, drafts, len(drafts) + 1)]
    rows = 2 * (len(drafts) + 1)
    bitmask = buffer.take(rows)
    _, counted = fill_until_remote(shards, entries, bitmask, buffer.segment_of(bitmask))
    expected = torch.empty(rows, WORDS, dtype=torch.int32)
    fill_draft_rows([(r.matcher, d, first) for r, d, first in entries], expected, num_threads=1)
    assert torch.equal(bitmask, expected)
    half = len(drafts) + 1
    assert not torch.equal(bitmask[:half], bitmask[half:])  # the ban cleared bits
    assert counted[half - 1] == counted[rows - 1]  # counted before the ban
    assert counted[rows - 1] == allowed_counts(expected, [rows - 1])[0]


def test_a_grammar_a_shard_cannot_compile_stays_in_process(compiler, tokenizer, shards, buffer):
    r = request(compiler, tokenizer, REGEX, "r0", "abc")
    r.matcher.recipe = Recipe("grammar", 'root ::= "never closed')  # the shard's compile fails
    bitmask = buffer.take(1)
    segment = buffer.segment_of(bitmask)
    deadline = time.monotonic() + 60
    while not shards._unshippable:  # the shard's failure comes back with a step's reply
        local, remote, pending = shards.dispatch([(r, [], 0)], segment)
        assert len(local) == 1 and not remote
        if pending is not None:
            assert pending.wait()[:2] == ([], None)
        assert time.monotonic() < deadline, "the shard never reported its failed compile"
        time.sleep(0.02)
    local, remote, pending = shards.dispatch([(r, [], 0)], segment)
    assert len(local) == 1 and not remote and pending is None  # in-process for good
