"""DFA tables made in a worker process equal those made in the thread; a worker's failure is
reported to the asker and the next request gets a working worker."""
from __future__ import annotations

import numpy as np
import pytest

from guided.fsm.backends.dfa_backend import DfaVocab, TokenDfa
from guided.fsm.schema_check import check_schema
from guided.fsm.schema_regex import schema_regex
from guided.fsm.table_worker import TableWorkers

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "maximum": 99},
                                           "name": {"type": "string", "maxLength": 5}},
          "required": ["id", "name"]}


def test_worker_tables_equal_the_threads(vocab):
    dfa_vocab = DfaVocab(vocab)
    regex = schema_regex(check_schema(SCHEMA))
    workers = TableWorkers(1, eos=dfa_vocab.eos_id, token_map=dfa_vocab.token_map,
                           num_words=dfa_vocab.num_words)
    try:
        here = TokenDfa(regex, dfa_vocab).build_tables(1 << 30)
        there = TokenDfa(regex, dfa_vocab).build_tables(1 << 30, workers)
        for name in ("states", "rows", "default_next", "exc_count", "exc_token", "exc_next"):
            assert np.array_equal(getattr(here, name), getattr(there, name)), name
        assert TokenDfa(regex, dfa_vocab).build_tables(10, workers) is None  # too large
        with pytest.raises(RuntimeError, match="worker failed"):
            workers.tables("(", 1 << 30)  # not a regex
        again = TokenDfa(regex, dfa_vocab).build_tables(1 << 30, workers)
        assert np.array_equal(again.exc_token, here.exc_token)
    finally:
        workers.shutdown()
