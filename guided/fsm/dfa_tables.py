"""A token DFA's transitions as flat tables, so that the device can step it: a multi-step
decode call then samples a DFA row's next token, and moves the row to its next state, without
the host between its steps (guided/worker/device_dfa.py, guided/kernels/dfa_advance.py).

Every state gets its row in the vocabulary's RowPool; the pool slot is the state's name in the
tables. A state's transitions are stored as the next state most of its tokens go to (inside a
string, almost the whole vocabulary goes to the same state) and the exceptions, sorted by
token, which the device finds by binary search. EOS is not a transition: a row that samples
it has ended.

Built once per grammar, after the grammar is served (a request never waits for it), in a worker
process (guided/fsm/table_worker.py) from the index's serialized form, so that reading every
transition holds that process's GIL, not the engine's; a grammar whose tables would be too
large keeps to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StateTables:
    """An index's tables over its states by position (0..S-1), as a worker process makes
    them: the states, each one's mask row, its most common next state (a position, -1: none),
    its exception count; the exceptions, state after state, sorted by token."""
    states: np.ndarray  # int64 [S]
    rows: np.ndarray  # int32 [S, words]
    default_next: np.ndarray  # int32 [S]
    exc_count: np.ndarray  # int32 [S]
    exc_token: np.ndarray  # int32 [E]
    exc_next: np.ndarray  # int32 [E], positions

    def with_slots(self, slots: np.ndarray) -> DfaTables:
        """The tables named by pool slots (slots[i]: the slot of states[i])."""
        slots = slots.astype(np.int32)
        return DfaTables(slots=slots,
                         default_next=np.where(self.default_next < 0, -1,
                                               slots[np.maximum(self.default_next, 0)]),
                         exc_count=self.exc_count, exc_token=self.exc_token,
                         exc_next=slots[self.exc_next])


@dataclass(frozen=True)
class DfaTables:
    """Per state (in the order of `slots`) its pool slot, its most common next state (a slot,
    -1: it has no transition) and how many exceptions it has; the exceptions of all states,
    state after state, each state's sorted by token."""
    slots: np.ndarray  # int32 [S]
    default_next: np.ndarray  # int32 [S]
    exc_count: np.ndarray  # int32 [S]
    exc_token: np.ndarray  # int32 [E]
    exc_next: np.ndarray  # int32 [E], slots

    @property
    def num_states(self) -> int:
        return len(self.slots)

    @property
    def num_exceptions(self) -> int:
        return len(self.exc_token)


def index_tables(index_bytes: bytes, num_words: int, eos: int) -> StateTables:
    """The tables of a serialized outlines-core Index (Index.__reduce__), eos allowed in its
    final states' rows. Runs in a worker process (guided/fsm/table_worker.py): reading the
    transitions builds a Python dict of every one, under the GIL."""
    import outlines_core as oc

    index = oc.Index.from_binary(index_bytes)
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
    return StateTables(
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
