"""Token DFAs on the device, for multi-step decode: a DFA row of a multi-step call is masked,
sampled and moved to its next state by the device alone (kernels/dfa_advance.py), so the host
neither waits for its tokens nor fills its rows between the call's steps.

One row table holds, below `offset`, a row allowing everything (0) and the rows the host fills
each step for the grammars that stay on the host (1..host_rows), and from `offset` on the rows of
every DFA state admitted, at offset + its RowPool slot: a DFA row's state is the row the sampler
reads. A grammar is admitted once its tables are built (fsm/dfa_tables.py, on a compile
thread) and while there is room (max_rows, max_exceptions): its rows, per-slot tables and
exceptions are copied up once. A grammar that goes away leaves its exceptions behind until a
compaction; its slots are reused by the pool, and whatever grammar takes them next writes
them again when admitted.
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
        self.eos = eos  # the stop token the DFAs allow in their final states
        self.device = device
        self.offset = 1 + host_rows
        self.max_rows = max_rows
        self.max_exceptions = max_exceptions
        self.rows = torch.zeros((self.offset + 256, num_words), dtype=torch.int32, device=device)
        self.rows[0] = -1
        slots = 256
        self.default_next = torch.zeros(slots, dtype=torch.int32, device=device)
        self.exc_start = torch.zeros(slots, dtype=torch.int32, device=device)
        self.exc_count = torch.zeros(slots, dtype=torch.int32, device=device)
        self.exc_token = torch.zeros(0, dtype=torch.int32, device=device)
        self.exc_next = torch.zeros(0, dtype=torch.int32, device=device)
        self._used = 0  # exceptions written, the dead grammars' included
        self._search_steps = 1
        self._live: weakref.WeakKeyDictionary[TokenDfa, int] = weakref.WeakKeyDictionary()
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
        if dfa not in self._live and not self.admit(dfa):
            return None
        return self.offset + dfa.slot_of(state)

    def admit(self, dfa: TokenDfa) -> bool:
        tables = dfa.tables
        if tables is None or dfa in self._refused:
            return False
        top = int(tables.slots.max()) + 1 if tables.num_states else 0
        if top > self.max_rows or not self._room_for(tables.num_exceptions):
            self._refused.add(dfa)
            log.debug("a DFA of %d states, %d exceptions stays on the host (no room on the "
                      "device)", tables.num_states, tables.num_exceptions)
            return False
        self._grow_slots(top)
        dev = self.device
        slots = torch.from_numpy(tables.slots.astype(np.int64)).to(dev)
        self.rows[self.offset + slots] = torch.from_numpy(dfa.pool.rows[tables.slots]).to(dev)
        default = np.where(tables.default_next < 0, 0, tables.default_next + self.offset)
        self.default_next[slots] = torch.from_numpy(default.astype(np.int32)).to(dev)
        self._write_exceptions(dfa, slots)
        longest = int(tables.exc_count.max()) if tables.num_states else 0
        self._search_steps = max(self._search_steps, math.ceil(math.log2(longest + 1)) + 1)
        return True

    def _write_exceptions(self, dfa: TokenDfa, slots: torch.Tensor) -> None:
        tables, dev = dfa.tables, self.device
        n = tables.num_exceptions
        start = self._used
        starts = start + np.cumsum(tables.exc_count, dtype=np.int64) - tables.exc_count
        self.exc_start[slots] = torch.from_numpy(starts.astype(np.int32)).to(dev)
        self.exc_count[slots] = torch.from_numpy(tables.exc_count).to(dev)
        if n:
            self.exc_token[start:start + n] = torch.from_numpy(tables.exc_token).to(dev)
            self.exc_next[start:start + n] = torch.from_numpy(
                tables.exc_next + np.int32(self.offset)).to(dev)
        self._used += n
        self._live[dfa] = n

    def _room_for(self, n: int) -> bool:
        """Room for n more exceptions (the dead grammars' dropped, the buffer grown, if need be)."""
        if self._used + n <= self.exc_token.numel():
            return True
        live = sum(self._live.values())
        if live + n > self.max_exceptions:
            return False
        size = min(self.max_exceptions, max(2 * (live + n), 1 << 16))
        survivors = list(self._live.keys())
        self.exc_token = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.exc_next = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._used = 0
        for dfa in survivors:  # their rows and defaults stand; their exceptions move
            slots = torch.from_numpy(dfa.tables.slots.astype(np.int64)).to(self.device)
            self._write_exceptions(dfa, slots)
        return True

    def _grow_slots(self, top: int) -> None:
        have = self.default_next.numel()
        if top <= have:
            return
        size = min(self.max_rows, max(top, 2 * have))
        rows = torch.zeros((self.offset + size, self.num_words), dtype=torch.int32,
                           device=self.device)
        rows[:self.offset + have] = self.rows
        self.rows = rows
        for name in ("default_next", "exc_start", "exc_count"):
            old = getattr(self, name)
            new = torch.zeros(size, dtype=torch.int32, device=self.device)
            new[:have] = old
            setattr(self, name, new)
