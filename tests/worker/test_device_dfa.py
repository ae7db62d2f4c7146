"""Token DFAs stepped on the device (here the CPU, through the torch reference): the table rows
a DFA's states read equal outlines-core's, and random walks moved by dfa_advance stand where a
Guide fed the same tokens stands, EOS ending them; the store's limits and compaction."""
from __future__ import annotations

import gc
import random

import numpy as np
import outlines_core as oc
import pytest
import torch

from guided.fsm.backends.dfa_backend import DfaVocab, TokenDfa
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_regex import schema_regex
from guided.kernels.dfa_advance import dfa_advance_ref
from guided.worker.device_dfa import DeviceDfa

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                               "maxItems": 2}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 2},
    {"enum": ["yes", "no", "maybe"]},
]


@pytest.fixture(scope="module")
def dfa_vocab():
    from guided.fsm.vocab import TokenVocab
    from guided.worker.loader import load_tokenizer

    return DfaVocab(TokenVocab.from_tokenizer(load_tokenizer("default")))


def make_dfa(schema, dfa_vocab) -> TokenDfa:
    dfa = TokenDfa(schema_regex(check_schema(schema)), dfa_vocab)
    assert dfa.build_tables(1 << 30) is not None
    return dfa


def store_for(dfa_vocab, **limits) -> DeviceDfa:
    return DeviceDfa(dfa_vocab.num_words, torch.device("cpu"), host_rows=4,
                     max_rows=limits.get("max_rows", 1 << 16),
                     max_exceptions=limits.get("max_exceptions", 1 << 22), eos=dfa_vocab.eos_id)


def allowed(row: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))


def test_walks_on_the_device_follow_the_guide(dfa_vocab):
    """Several grammars in one batch, each row a random walk: every step the row the state
    names equals the Guide's own row, and the advanced state is the Guide's next state."""
    dfas = [make_dfa(s, dfa_vocab) for s in SCHEMAS]
    store = store_for(dfa_vocab)
    words, eos = dfa_vocab.num_words, dfa_vocab.eos_id
    rng = random.Random(0)
    guides = [oc.Guide(d.index) for d in dfas for _ in range(3)]
    owners = [d for d in dfas for _ in range(3)]
    states = torch.tensor([store.row_of(d, g.get_state()) for d, g in zip(owners, guides)],
                          dtype=torch.int32)
    ended = [False] * len(guides)
    reference = torch.zeros(words, dtype=torch.int32)
    for step in range(60):
        tokens = []
        for i, (dfa, guide) in enumerate(zip(owners, guides)):
            if ended[i]:
                assert states[i] == 0 and bool((store.rows[0] == -1).all())
                tokens.append(0)
                continue
            guide.write_mask_into(reference.data_ptr(), words, 4)
            row = store.rows[states[i]]
            assert torch.equal(row, reference), (i, step)
            ids = allowed(row)
            if eos in ids and (len(ids) == 1 or rng.random() < 0.2):
                tokens.append(eos)
                ended[i] = True
                continue
            token = int(rng.choice([t for t in ids if t != eos]))
            guide.advance(token, return_tokens=False)
            tokens.append(token)
        states = dfa_advance_ref(states, torch.tensor(tokens), store.tables, eos=eos)
        for i, (dfa, guide) in enumerate(zip(owners, guides)):
            if not ended[i]:
                assert states[i] == store.row_of(dfa, guide.get_state())
    assert any(ended)


def test_rows_below_the_offset_stand_still(dfa_vocab):
    dfa = make_dfa(SCHEMAS[2], dfa_vocab)
    store = store_for(dfa_vocab)
    start = store.row_of(dfa, dfa.index.get_initial_state())
    states = torch.tensor([-1, 0, 1, 3, start], dtype=torch.int32)
    moved = dfa_advance_ref(states, torch.tensor([5, 6, 7, 8, dfa_vocab.eos_id]), store.tables,
                            eos=dfa_vocab.eos_id)
    assert moved.tolist() == [-1, 0, 1, 3, 0]


def test_limits_keep_grammars_on_the_host_and_dead_ones_are_compacted(dfa_vocab):
    big = make_dfa(SCHEMAS[0], dfa_vocab)
    assert store_for(dfa_vocab, max_rows=1).row_of(big, big.index.get_initial_state()) is None
    small_limit = store_for(dfa_vocab, max_exceptions=1)
    assert big.tables.num_exceptions > 1
    assert small_limit.row_of(big, big.index.get_initial_state()) is None
    # the index's serialized size bounds which grammars get tables at all
    other = TokenDfa(schema_regex(check_schema(SCHEMAS[0])), dfa_vocab)
    assert other.build_tables(10) is None and other.tables is None

    keep = make_dfa(SCHEMAS[1], dfa_vocab)
    n = big.tables.num_exceptions
    limit = 3 * n + keep.tables.num_exceptions
    store = store_for(dfa_vocab, max_exceptions=limit)
    assert store.row_of(keep, keep.index.get_initial_state()) is not None
    for _ in range(8):  # grammars that come and go: room is made by dropping the dead ones'
        gone = make_dfa(SCHEMAS[0], dfa_vocab)
        assert store.row_of(gone, gone.index.get_initial_state()) is not None
        assert store.exc_token.numel() <= limit and store.num_grammars <= 2
        del gone
        gc.collect()
    assert store.num_grammars == 1
    guide = oc.Guide(keep.index)  # the survivor's exceptions moved and still serve it
    state = torch.tensor([store.row_of(keep, guide.get_state())], dtype=torch.int32)
    for token in (ids for ids in [dfa_vocab.byte_token[ord(c)] for c in '["2024-01-3']):
        guide.advance(token, return_tokens=False)
        state = dfa_advance_ref(state, torch.tensor([token]), store.tables, eos=dfa_vocab.eos_id)
        assert int(state) == store.row_of(keep, guide.get_state())
