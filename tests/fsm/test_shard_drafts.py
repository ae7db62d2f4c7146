"""Drafts walked in mask shards: the same (anchor, drafts, forced count) as the loop's own walk
on the same committed tokens (forced text, prompt lookup, anchored on in-flight drafts, a
banned token cut), the mirrors caught up with tokens committed since, and a dead shard's asks
handed back to walk in-process."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from guided.fsm.backends.xgrammar_backend import token_ban
from guided.masks.bitmask_fill import fill_draft_rows
from guided.fsm.jump_forward import CachedEncoder, DraftAsk, make_drafts
from guided.fsm.mask_shards import MaskShards
from guided.engine.ngram import NgramIndex
from guided.params import ConstraintSpec
from guided.worker.host_bitmasks import HostBitmasks

VOCAB = 49152
WORDS = VOCAB // 32
SCHEMA = ConstraintSpec.json_schema({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "city": {"type": "string"},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}}},
    "required": ["name", "city", "tags"], "additionalProperties": False})
REGEX = ConstraintSpec("regex", r"[a-z]{1,12}-[0-9]{2,6}(-[a-z]+)?")


@pytest.fixture(scope="module")
def encoder(tokenizer):
    e = CachedEncoder(tokenizer)
    assert e.backend_json is not None  # the default tokenizer takes the Rust path
    return e


@pytest.fixture()
def shards(compiler, encoder, tokenizer):
    special = frozenset(tokenizer.all_special_ids)
    s = MaskShards(compiler.xgrammar_tokenizer_info, 2, drafting=(
        encoder.backend_json, compiler.vocab.token_bytes, compiler.vocab.eos_token_ids, special))
    assert s.wait_ready(120), "the shards did not start"
    yield s
    s.shutdown()


def request(compiler, tokenizer, spec, request_id: str, prompt: str, text: str):
    matcher = compiler.compile(spec, timeout=60).matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        assert matcher.accept_token(token)
    return SimpleNamespace(request_id=request_id, matcher=matcher, output_token_ids=tokens,
                           prompt_token_ids=tokenizer.encode(prompt, add_special_tokens=False))


def mirror(shards, requests) -> None:
    """Place the requests' mirrors (as a step's fill does) until every one is in a shard."""
    host = HostBitmasks(WORDS, torch.device("cpu"), shared=True)
    try:
        bitmask = host.take(len(requests))
        entries = [(r, [], i) for i, r in enumerate(requests)]
        deadline = time.monotonic() + 60
        while True:
            local, _, pending = shards.dispatch(entries, host.segment_of(bitmask))
            if local:
                fill_draft_rows(local, bitmask, num_threads=1)
            assert (pending.wait()[:2] if pending else ([], None)) == ([], None)
            if not local:
                return
            assert time.monotonic() < deadline, "grammars never reached the shards"
            time.sleep(0.02)
    finally:
        host.release()


def in_process(encoder, compiler, tokenizer, r, ask: DraftAsk):
    lookup = NgramIndex(frozenset(tokenizer.all_special_ids))
    lookup.sync(r.prompt_token_ids, r.output_token_ids)
    return make_drafts(encoder, compiler.vocab.token_bytes, r.matcher, r.output_token_ids, ask,
                       lookup)


def test_shard_drafts_equal_the_loops_own(compiler, tokenizer, encoder, shards):
    prompt = 'Write {"name": "Ada Lovelace", "city": "London"} with tags alpha then beta.'
    requests = [request(compiler, tokenizer, SCHEMA, "j0", prompt, '{"name": "Ada'),
                request(compiler, tokenizer, SCHEMA, "j1", prompt, '{"name": "x", "city'),
                request(compiler, tokenizer, SCHEMA, "j2", prompt, '{"name": "x", "city": "y", '),
                request(compiler, tokenizer, REGEX, "r0", "code abc-123-xyz", "abc")]
    mirror(shards, requests)
    results = []
    for round_ in range(2):
        # a step asks once a request: plain, without lookup, anchored on the in-flight drafts
        for kind in ("plain", "no lookup", "anchored"):
            asks = [(r, ask_of(kind, encoder, compiler, tokenizer, r)) for r in requests]
            local, pending = shards.ask_drafts(asks)
            assert not local and pending is not None
            done, failed = pending.wait()
            assert not failed and sorted(r.request_id for r, _ in done) == ["j0", "j1", "j2", "r0"]
            got = {r.request_id: result for r, result in done}
            for r, ask in asks:
                assert got[r.request_id] == in_process(encoder, compiler, tokenizer, r, ask)
            results.extend(got.values())
        # tokens committed since (each one's plain drafts): the mirrors catch up with the next
        for r in requests:
            _, drafts, _ = in_process(encoder, compiler, tokenizer, r, DraftAsk(8, 4, None))
            for token in drafts:
                assert r.matcher.accept_token(token)
                r.output_token_ids.append(token)
    assert any(n < len(drafts) for _, drafts, n in results)  # lookup guesses drafted
    assert any(n for _, _, n in results)  # forced text drafted
    assert any(anchor is not None for anchor, _, _ in results)


def test_a_first_proposal_is_walked_in_a_shard_before_any_fill(compiler, tokenizer, encoder,
                                                                 shards):
    """A request's first drafts come before its first row: its mirror is placed with them."""
    prompt = 'Write {"name": "Ada Lovelace", "city": "London"} with tags alpha then beta.'
    mirror(shards, [request(compiler, tokenizer, SCHEMA, "j0", prompt, "")])  # the grammar ships
    fresh = request(compiler, tokenizer, SCHEMA, "j1", prompt, '{"name": "Ada')
    ask = DraftAsk(8, 4, None)
    local, pending = shards.ask_drafts([(fresh, ask)])
    assert not local and pending is not None
    done, failed = pending.wait()
    assert not failed and done[0][1] == in_process(encoder, compiler, tokenizer, fresh, ask)


def ask_of(kind: str, encoder, compiler, tokenizer, r) -> DraftAsk:
    if kind == "plain":
        return DraftAsk(8, 4, None)
    if kind == "no lookup":
        return DraftAsk(2, 0, None)
    _, drafts, _ = in_process(encoder, compiler, tokenizer, r, DraftAsk(4, 4, None))
    return DraftAsk(6, 4, tuple(drafts))


def test_a_banned_lookup_token_is_cut_as_in_process(compiler, tokenizer, encoder, shards):
    """A matcher's ban (JSON's: raw control bytes) holds on its mirror too."""
    prompt = 'Write {"name": "Ada Lovelace"}'
    r = request(compiler, tokenizer, SCHEMA, "j0", prompt, '{"name": "Ada')
    ask = DraftAsk(8, 4, None)
    _, drafts, num_forced = in_process(encoder, compiler, tokenizer, r, ask)
    assert len(drafts) > num_forced  # the lookup guesses " Lovelace"
    r.matcher.ban = token_ban(r.matcher.ban.ids | {drafts[num_forced + 1]}, VOCAB)
    mirror(shards, [r])
    _, pending = shards.ask_drafts([(r, ask)])
    done, _ = pending.wait()
    expected = in_process(encoder, compiler, tokenizer, r, ask)
    assert done[0][1] == expected and len(expected[1]) == num_forced + 1


def test_a_dead_shard_hands_its_asks_back(compiler, tokenizer, shards):
    requests = [request(compiler, tokenizer, SCHEMA, f"j{i}", "", '{"name": "') for i in range(4)]
    mirror(shards, requests)
    for shard in shards._shards:
        shard.process.kill()
        shard.process.wait()
    asks = [(r, DraftAsk(8, 0, None)) for r in requests]
    local, pending = shards.ask_drafts(asks)
    failed = [] if pending is None else pending.wait()[1]
    assert sorted(r.request_id for r, _ in local + failed) == ["j0", "j1", "j2", "j3"]
    local, pending = shards.ask_drafts(asks)  # from now on in-process
    assert len(local) == 4 and pending is None


def test_a_drafts_reply_nobody_waits_for_is_passed_over(compiler, tokenizer, encoder, shards):
    """A step that failed between its asks and their replies: the next fill and the next asks
    still get their own replies."""
    requests = [request(compiler, tokenizer, SCHEMA, f"j{i}", "", '{"name": "') for i in range(4)]
    mirror(shards, requests)
    asks = [(r, DraftAsk(8, 0, None)) for r in requests]
    _, stale = shards.ask_drafts(asks)
    assert stale is not None  # never waited for
    host = HostBitmasks(WORDS, torch.device("cpu"), shared=True)
    try:
        bitmask = host.take(4)
        local, _, pending = shards.dispatch([(r, [], i) for i, r in enumerate(requests)],
                                            host.segment_of(bitmask))
        assert not local and pending.wait()[:2] == ([], None)
    finally:
        host.release()
    local, pending = shards.ask_drafts(asks)
    done, failed = pending.wait()
    assert not local and not failed
    assert {r.request_id: result for r, result in done} == {
        r.request_id: in_process(encoder, compiler, tokenizer, r, ask) for r, ask in asks}


def test_a_fault_while_drafting_fails_the_shard_and_its_rows_come_back(compiler, tokenizer,
                                                                      shards):
    """A mirror that rejects a token while drafting is out of step: its shard's asks and the
    rows of the step already sent to it are handed back, and the shard is no longer used."""
    r = request(compiler, tokenizer, SCHEMA, "j0", "", '{"name": "x", "city": "y", ')
    mirror(shards, [r])
    shards._mirrors["j0"].synced = 0  # the mirror is sent its tokens again: '{' is no key
    host = HostBitmasks(WORDS, torch.device("cpu"), shared=True)
    try:
        _, asked = shards.ask_drafts([(r, DraftAsk(8, 0, None))])
        bitmask = host.take(1)
        _, remote, pending = shards.dispatch([(r, [], 0)], host.segment_of(bitmask))
        assert remote  # sent before the drafts' fault is known
        done, failed = asked.wait()
        assert not done and [x for x, _ in failed] == [r]
        assert pending.wait()[0] == remote  # its rows are filled in-process
    finally:
        host.release()
    local, asked = shards.ask_drafts([(r, DraftAsk(8, 0, None))])
    assert len(local) == 1 and asked is None
