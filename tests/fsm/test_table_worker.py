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
    workers = TableWorkers(1)
    try:
        here, there = TokenDfa(regex, dfa_vocab), TokenDfa(regex, dfa_vocab)
        a = here.build_tables(1 << 30)
        b = there.build_tables(1 << 30, workers)
        for name in ("default_next", "exc_count", "exc_token", "exc_next", "slots"):
            x, y = getattr(a, name), getattr(b, name)
            if name in ("default_next", "exc_next", "slots"):  # slots differ: compare rows
                x = np.where(x < 0, -1, x)
                y = np.where(y < 0, -1, y)
                assert x.shape == y.shape
                rows = dfa_vocab.pool.rows
                assert (rows[x[x >= 0]] == rows[y[y >= 0]]).all()
            else:
                assert np.array_equal(x, y), name
        with pytest.raises(RuntimeError, match="worker failed"):
            workers.tables(b"not an index", dfa_vocab.num_words, dfa_vocab.eos_id)
        again = TokenDfa(regex, dfa_vocab).build_tables(1 << 30, workers)
        assert np.array_equal(again.exc_token, a.exc_token)
    finally:
        workers.shutdown()
