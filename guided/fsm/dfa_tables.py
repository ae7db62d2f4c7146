"""A token DFA's transitions as flat tables, so that the device can step it: a multi-step
decode call then samples a DFA row's next token, and moves the row to its next state, without
the host between its steps (guided/worker/device_dfa.py, guided/kernels/dfa_advance.py).

States are named by their position among the index's states, sorted. A state's transitions
are stored as the next state most of its tokens go to (inside a string, almost the whole
vocabulary goes to the same state) and the exceptions, sorted by token, which the device
finds by binary search. EOS is not a transition: a row that samples it has ended.

Built once per grammar, after the grammar is served (a request never waits for it), in a worker
process (guided/fsm/table_worker.py) that builds the index again from its regex, so that
neither the index's serialization nor reading every transition holds the engine's GIL; a
grammar whose tables would be too large keeps to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DfaTables:
    """An index's tables over its states by position (0..S-1, the states sorted): each one's
    mask row, its most common next state (a position, -1: it has no transition), its exception
    count; the exceptions, state after state, each state's sorted by token."""
    states: np.ndarray  # int64 [S]
    rows: np.ndarray  # int32 [S, words]
    default_next: np.ndarray  # int32 [S]
    exc_count: np.ndarray  # int32 [S]
    exc_token: np.ndarray  # int32 [E]
    exc_next: np.ndarray  # int32 [E], positions

    @property
    def num_states(self) -> int:
        return len(self.states)

    @property
    def num_exceptions(self) -> int:
        return len(self.exc_token)

    def position(self, state: int) -> int:
        """A state's position (the tables' name for it)."""
        return int(np.searchsorted(self.states, state))


def index_tables(index, num_words: int, eos: int, max_bytes: int) -> DfaTables | None:
    """The tables of an outlines-core Index, eos allowed in its final states' rows; None where
    the index serializes to more than max_bytes (~7 bytes a transition: the tables would be
    as large). Runs in a worker process (guided/fsm/table_worker.py): reading the transitions
    builds a Python dict of every one, under the GIL."""
    if len(index.__reduce__()[1][0]) > max_bytes:
        return None
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    states = sorted(set(transitions) | finals | {index.get_initial_state()})
    position = np.full(max(states) + 1, -1, dtype=np.int32)
    position[np.asarray(states)] = np.arange(len(states), dtype=np.int32)
    rows = np.zeros((len(states), num_words), dtype=np.int32)
    default_next = np.full(len(states), -1, dtype=np.int32)
    exc_count = np.zeros(len(states), dtype=np.int32)
    exc_tokens: list[np.ndarray] = []
    exc_nexts: list[np.ndarray] = []
    for i, state in enumerate(states):
        edges = transitions.get(state) or {}
        n = len(edges)
        tokens = np.fromiter(edges.keys(), dtype=np.int32, count=n)
        rows[i] = row_of(tokens, num_words, eos if state in finals else None)
        if not n:
            continue
        targets = position[np.fromiter(edges.values(), dtype=np.int64, count=n)]
        values, counts = np.unique(targets, return_counts=True)
        common = values[np.argmax(counts)]
        default_next[i] = common
        other = targets != common
        if other.any():
            tokens, targets = tokens[other], targets[other]
            order = np.argsort(tokens, kind="stable")
            exc_tokens.append(tokens[order])
            exc_nexts.append(targets[order])
            exc_count[i] = len(order)
    empty = np.zeros(0, dtype=np.int32)
    return DfaTables(
        states=np.asarray(states, dtype=np.int64), rows=rows, default_next=default_next,
        exc_count=exc_count,
        exc_token=np.concatenate(exc_tokens) if exc_tokens else empty,
        exc_next=np.concatenate(exc_nexts) if exc_nexts else empty)


def row_of(tokens: np.ndarray, num_words: int, eos: int | None) -> np.ndarray:
    """A mask row (int32 words, bit t of word t // 32 for token t) allowing `tokens` (and eos)."""
    bits = np.zeros(num_words * 32, dtype=bool)
    bits[tokens] = True
    if eos is not None:
        bits[eos] = True
    return np.packbits(bits, bitorder="little").view(np.int32)
