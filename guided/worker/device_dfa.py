"""Token DFAs on the device, for multi-step decode: a DFA row of a multi-step call is masked,
sampled and moved to its next state by the device alone (kernels/dfa_advance.py), so the host
neither waits for its tokens nor fills its rows between the call's steps.

One row table holds, below `offset`, a row allowing everything (0) and the rows the host fills
each step for the grammars that stay on the host (1..host_rows); from `offset` on, each
admitted grammar's states in a block of their own, in the order of its tables
(fsm/dfa_tables.py): a DFA row's state is the row the sampler reads. A grammar is admitted once
its tables are built (on a worker process) and while there is room (max_rows states,
max_exceptions transitions): its rows, per-state tables and exceptions are copied up once. A
grammar that goes away leaves its block behind; when room runs out the live grammars are
packed again from their tables, which they keep.
"""
from __future__ import annotations

import logging
import math
import weakref

import numpy as np
import torch

from guided.fsm.backends.dfa_backend import TokenDfa
from guided.kernels.dfa_advance import AdvanceTables

log = logging.getLogger(__name__)


class DeviceDfa:
    def __init__(self, num_words: int, device: torch.device, *, host_rows: int, max_rows: int,
                 max_exceptions: int, eos: int):
        self.num_words = num_words
        self.device = device
        self.eos = eos  # the stop token the DFAs allow in their final states
        self.offset = 1 + host_rows
        self.max_rows = max_rows
        self.max_exceptions = max_exceptions
        self.rows = torch.zeros((self.offset, num_words), dtype=torch.int32, device=device)
        self.rows[0] = -1
        self.default_next = self.exc_start = self.exc_count = self._ints(0)
        self.exc_token = self.exc_next = self._ints(0)
        self._next_state = 0  # the next free block starts here (dead grammars' included)
        self._next_exception = 0
        self._search_steps = 1
        # each admitted grammar's first state (its block's start) and first exception
        self._live: weakref.WeakKeyDictionary[TokenDfa, tuple[int, int]] = (
            weakref.WeakKeyDictionary())
        self._refused: weakref.WeakSet[TokenDfa] = weakref.WeakSet()  # too large: not asked again

    @property
    def tables(self) -> AdvanceTables:
        return AdvanceTables(self.offset, self.default_next, self.exc_start, self.exc_count,
                             self.exc_token, self.exc_next, self._search_steps)

    @property
    def num_grammars(self) -> int:
        return len(self._live)

    def row_of(self, dfa: TokenDfa, state: int) -> int | None:
        """The table row of `state` of an admitted grammar (admitted now where it can be)."""
        placed = self._live.get(dfa)
        if placed is None:
            if not self.admit(dfa):
                return None
            placed = self._live[dfa]
        return self.offset + placed[0] + dfa.tables.position(state)

    def admit(self, dfa: TokenDfa) -> bool:
        tables = dfa.tables
        if tables is None or dfa in self._refused:
            return False
        if dfa in self._live:
            return True
        if not self._room_for(tables.num_states, tables.num_exceptions):
            self._refused.add(dfa)
            log.debug("a DFA of %d states, %d exceptions stays on the host (no room on the "
                      "device)", tables.num_states, tables.num_exceptions)
            return False
        self._place(dfa)
        return True

    def _place(self, dfa: TokenDfa) -> None:
        """Copies a grammar's tables into the next free block (room made beforehand)."""
        t, dev = dfa.tables, self.device
        first, n = self._next_state, t.num_states
        exc, e = self._next_exception, t.num_exceptions
        row0 = self.offset + first
        self.rows[row0:row0 + n] = torch.from_numpy(t.rows).to(dev)
        self.default_next[first:first + n] = torch.from_numpy(
            np.where(t.default_next < 0, 0, t.default_next + row0).astype(np.int32)).to(dev)
        starts = exc + np.cumsum(t.exc_count, dtype=np.int64) - t.exc_count
        self.exc_start[first:first + n] = torch.from_numpy(starts.astype(np.int32)).to(dev)
        self.exc_count[first:first + n] = torch.from_numpy(t.exc_count).to(dev)
        if e:
            self.exc_token[exc:exc + e] = torch.from_numpy(t.exc_token).to(dev)
            self.exc_next[exc:exc + e] = torch.from_numpy(t.exc_next + np.int32(row0)).to(dev)
        self._next_state += n
        self._next_exception += e
        self._live[dfa] = (first, exc)
        longest = int(t.exc_count.max()) if n else 0
        self._search_steps = max(self._search_steps, math.ceil(math.log2(longest + 1)) + 1)

    def _room_for(self, num_states: int, num_exceptions: int) -> bool:
        """Room for a grammar's block, made by packing the live grammars again (the dead ones'
        blocks dropped) and growing the tables, up to the limits."""
        states = self.default_next.numel()
        exceptions = self.exc_token.numel()
        if (self._next_state + num_states <= states
                and self._next_exception + num_exceptions <= exceptions):
            return True
        survivors = list(self._live.keys())
        live_states = sum(d.tables.num_states for d in survivors) + num_states
        live_exceptions = sum(d.tables.num_exceptions for d in survivors) + num_exceptions
        if live_states > self.max_rows or live_exceptions > self.max_exceptions:
            return False
        states = min(self.max_rows, max(2 * live_states, states, 1024))
        exceptions = min(self.max_exceptions, max(2 * live_exceptions, exceptions, 1 << 16))
        rows = torch.zeros((self.offset + states, self.num_words), dtype=torch.int32,
                           device=self.device)
        rows[:self.offset] = self.rows[:self.offset]
        self.rows = rows
        self.default_next, self.exc_start, self.exc_count = (
            self._ints(states), self._ints(states), self._ints(states))
        self.exc_token, self.exc_next = self._ints(exceptions), self._ints(exceptions)
        self._next_state = self._next_exception = 0
        self._live = weakref.WeakKeyDictionary()
        for dfa in survivors:
            self._place(dfa)
        return True

    def _ints(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)
