"""Token-level DFA masks for JSON schemas: a schema whose language is regular is compiled to an
outlines-core index of its regex, and each DFA state's mask row is written once and then copied.

Why: xgrammar fills a row by walking a pushdown automaton over the vocabulary (9 us a row
batched on two threads, ~50 us alone, on the CPU here), which at concurrency 256 is
milliseconds of host work a step, longer than a small model's forward pass. A token-level DFA's
row depends on the state alone, so a state seen before costs a ~1 us copy; the first visit
costs what outlines-core takes to write it (~1 us in JSON structure, ~50 us inside a string,
whose state then recurs for every token of the string). Accepting a token is one hash lookup
(~0.4 us). The forced continuation (jump-forward) of a state is the chain of
states that allow a single next byte, probed through the single-byte tokens and memoized too.

Exactness: only schemas whose regex is exact are served here (guided/fsm/schema_regex.py says
why not otherwise); the rest stay on xgrammar.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import outlines_core as oc
import torch

from guided.fsm.matcher import MAX_ROLLBACK_TOKENS, Matcher
from guided.fsm.vocab import TokenVocab

_MAX_FORCED_BYTES = 512


class RowPool:
    """Every DFA's memoized rows in one table (int32 words, the bitmask convention of Matcher),
    so that a step's rows are one gather whatever grammars they belong to. Rows are written
    under a lock and never move within a published table: a grown table is a copy, published
    before the slots it adds, so a reader that found its slots finds their rows."""

    def __init__(self, num_words: int):
        self.rows = np.zeros((256, num_words), dtype=np.int32)  # (slots, words)
        self.lock = threading.Lock()
        self._size = 0
        self._free: list[int] = []

    def write(self, write_row) -> int:
        """A new slot whose row `write_row(pointer, num_words)` fills (caller holds the lock)."""
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._size = self._size, self._size + 1
        rows = self.rows
        if slot >= rows.shape[0]:
            rows = np.concatenate([rows, np.zeros_like(rows)])
        write_row(rows[slot].ctypes.data, rows.shape[1])
        self.rows = rows
        return slot

    def release(self, slots: dict[int, int]) -> None:
        """A DFA went away: its rows' slots are free again."""
        with self.lock:
            self._free.extend(slots.values())

    @property
    def num_rows(self) -> int:
        return self._size - len(self._free)


class DfaVocab:
    """One per tokenizer: the outlines-core vocabulary, the single-byte tokens and the pool of
    mask rows its DFAs share."""

    def __init__(self, vocab: TokenVocab):
        token_map: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(vocab.token_bytes):
            if data and token_id not in vocab.special_ids:
                token_map.setdefault(data, []).append(token_id)
        self.token_map = token_map
        self.eos_id = vocab.eos_token_ids[0]  # the one stop token the index allows
        self.vocabulary = oc.Vocabulary(self.eos_id, token_map)
        self.num_words = (vocab.vocab_size + 31) // 32
        self.pool = RowPool(self.num_words)
        self.byte_token = {data[0]: ids[0] for data, ids in token_map.items() if len(data) == 1}
        self.byte_tokens = sorted(self.byte_token.items())  # (byte, token id)
        # forced bytes are found by probing single-byte tokens: exact only if every byte a
        # token can start with is one
        self.probe_bytes = {data[0] for data in token_map} <= self.byte_token.keys()


class TokenDfa:
    """A schema's index and its memoized rows (in the vocabulary's RowPool), shared by every
    request of the schema and by the step's threads."""

    def __init__(self, regex: str, vocab: DfaVocab):
        self.regex = regex
        self.index = oc.Index(regex, vocab.vocabulary)
        self.vocab = vocab
        self.pool = vocab.pool
        self._slots: dict[int, int] = {}  # state -> its row in the pool
        self._forced: dict[int, bytes] = {}
        weakref.finalize(self, self.pool.release, self._slots)

    @property
    def num_rows(self) -> int:
        return len(self._slots)

    def slot(self, state: int, guide: oc.Guide) -> int:
        """The row of `state`, which `guide` stands in (written on the first visit)."""
        slot = self._slots.get(state)
        return slot if slot is not None else self._write(state, guide)

    def _write(self, state: int, guide: oc.Guide) -> int:
        with self.pool.lock:
            slot = self._slots.get(state)
            if slot is None:
                slot = self.pool.write(lambda pointer, words: guide.write_mask_into(
                    pointer, words, 4))
                self._slots[state] = slot
            return slot

    def forced(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with (b"" if none)."""
        cached = self._forced.get(state)
        if cached is not None:
            return cached
        if not self.vocab.probe_bytes:
            return b""
        chain, forced = [state], bytearray()
        while len(forced) < _MAX_FORCED_BYTES:
            step = self._single_byte(chain[-1])
            if step is None or step[1] in chain:
                break
            forced.append(step[0])
            chain.append(step[1])
        forced = bytes(_complete_utf8(forced))
        for i, s in enumerate(chain[:len(forced) + 1]):  # every state of the chain: its tail
            self._forced.setdefault(s, forced[i:])
        return self._forced[state]

    def _single_byte(self, state: int) -> tuple[int, int] | None:
        """(byte, next state) if a non-final state allows exactly one next byte."""
        if self.index.is_final_state(state):
            return None
        found = None
        next_state = self.index.get_next_state
        for byte, token in self.vocab.byte_tokens:
            target = next_state(state, token)
            if target is not None:
                if found is not None:
                    return None
                found = (byte, target)
        return found


def _complete_utf8(data: bytearray) -> bytearray:
    """data without a trailing incomplete UTF-8 sequence (a forced string ends on a character)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: keep its sequence only if complete
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


class DfaMatcher(Matcher):
    """A request's state in a TokenDfa (an outlines-core Guide, which keeps the rollback
    window); EOS is ours to track, as the index has no transition for it."""

    __slots__ = ("_dfa", "_eos", "_guide", "_num_tokens", "_terminated")

    def __init__(self, dfa: TokenDfa, vocab: TokenVocab):
        self._dfa = dfa
        self._guide = oc.Guide(dfa.index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._eos = dfa.vocab.eos_id
        self._num_tokens = len(vocab.token_bytes)
        self._terminated = False

    @property
    def dfa(self) -> TokenDfa:
        return self._dfa

    @property
    def state(self) -> int:
        return self._guide.get_state()

    def row_slot(self) -> int:
        """The memoized row of the current state (not for a terminated matcher)."""
        return self._dfa.slot(self._guide.get_state(), self._guide)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._num_tokens:
            return False
        if token_id == self._eos:
            if not self._dfa.index.is_final_state(self._guide.get_state()):
                return False
            self._terminated = True
            return True
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # not allowed here
            return False
        return True

    def ended_with(self, token_id: int) -> bool:
        return token_id == self._eos and self._terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            bitmask[row].zero_()
            return
        slot = self.row_slot()
        bitmask[row].numpy()[:] = self._dfa.pool.rows[slot]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:  # the EOS is the last token and the Guide never saw it
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_string(self) -> bytes:
        if self._terminated:
            return b""
        return self._dfa.forced(self._guide.get_state())

    def accept_bytes(self, data: bytes) -> bool:
        if self._terminated:
            return False
        tokens = [self._dfa.vocab.byte_token.get(b) for b in data]
        if any(t is None for t in tokens) or not self._guide.accepts_tokens(tokens):
            return False
        for token in tokens:
            self._guide.advance(token, return_tokens=False)
        return True


def fill_dfa_rows(items: list[tuple[DfaMatcher, int]], bitmask: torch.Tensor) -> None:
    """The matchers' memoized rows copied into their bitmask rows (int32, on the CPU) in one
    gather per pool; terminated matchers' rows zeroed."""
    words = bitmask.numpy()
    by_pool: dict[int, tuple[RowPool, list[int], list[int]]] = {}
    for matcher, row in items:
        if matcher.is_terminated():
            words[row] = 0
            continue
        pool = matcher.dfa.pool
        _, rows, slots = by_pool.setdefault(id(pool), (pool, [], []))
        rows.append(row)
        slots.append(matcher.row_slot())
    for pool, rows, slots in by_pool.values():
        words[rows] = pool.rows[slots]  # the table read after its slots: see RowPool
