"""Character-level FSM of a regex with forced chains collapsed into jump edges (for jump-forward).

A state is *forced* when it is not accepting and has exactly one live outgoing transition, on a
single character. Following forced states from any state yields the string the regex forces
from there; each state's chain is computed once (the "jump edge") and cached.

    s0 --'{'--> s1 --'"'--> s2 --[a-z]--> ...      forced_from(s0) == '{"'
"""
from __future__ import annotations

from dataclasses import dataclass, field

import interegular
from interegular.fsm import anything_else

from guided.errors import ConstraintError


@dataclass
class CompressedFSM:
    initial: int
    finals: frozenset[int]
    transitions: dict[int, dict[str, int]]  # state -> {single char: next state} (live only)
    any_char: dict[int, int]  # state -> next state on any character not listed in the alphabet
    _jumps: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_regex(cls, pattern: str) -> CompressedFSM:
        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as e:  # interegular raises several exception types on bad syntax
            raise ConstraintError(f"cannot build an FSM for regex {pattern!r}: {e}") from None
        chars_of: dict[int, list[str]] = {}
        for char, symbol in fsm.alphabet.items():
            if char is not anything_else:
                chars_of.setdefault(symbol, []).append(char)
        other_symbol = fsm.alphabet[anything_else] if anything_else in fsm.alphabet else None
        live = _live_states(fsm)
        transitions: dict[int, dict[str, int]] = {}
        any_char: dict[int, int] = {}
        for state in live:
            edges: dict[str, int] = {}
            for symbol, target in fsm.map.get(state, {}).items():
                if target not in live:
                    continue
                if symbol == other_symbol:
                    any_char[state] = target
                for char in chars_of.get(symbol, []):
                    edges[char] = target
            transitions[state] = edges
        if fsm.initial not in live:
            raise ConstraintError(f"regex {pattern!r} matches no string")
        return cls(fsm.initial, frozenset(s for s in fsm.finals if s in live), transitions,
                   any_char)

    def is_final(self, state: int) -> bool:
        return state in self.finals

    def step(self, state: int, char: str) -> int | None:
        edges = self.transitions.get(state)
        if edges is None:
            return None
        target = edges.get(char)
        return target if target is not None else self.any_char.get(state)

    def advance(self, state: int, text: str) -> int | None:
        """The state after reading text from state, or None if the regex rejects it."""
        for char in text:
            state = self.step(state, char)
            if state is None:
                return None
        return state

    def forced_from(self, state: int) -> str:
        """The string every match continuing from state must read next ("" if none)."""
        return self._jump(state)[0]

    def _jump(self, state: int) -> tuple[str, int]:
        cached = self._jumps.get(state)
        if cached is not None:
            return cached
        chars: list[str] = []
        seen = {state}
        current = state
        while current not in self.finals and current not in self.any_char:
            edges = self.transitions.get(current, {})
            if len(edges) != 1:
                break
            (char, target), = edges.items()
            if target in seen:  # a forced cycle cannot end (no final state): stop the walk
                break
            chars.append(char)
            seen.add(target)
            current = target
        result = ("".join(chars), current)
        self._jumps[state] = result
        return result


def _live_states(fsm) -> set[int]:
    """States reachable from the initial state that can still reach an accepting state."""
    reverse: dict[int, set[int]] = {}
    reachable = {fsm.initial}
    stack = [fsm.initial]
    while stack:
        state = stack.pop()
        for target in fsm.map.get(state, {}).values():
            reverse.setdefault(target, set()).add(state)
            if target not in reachable:
                reachable.add(target)
                stack.append(target)
    alive = {s for s in fsm.finals if s in reachable}
    stack = list(alive)
    while stack:
        state = stack.pop()
        for source in reverse.get(state, ()):
            if source not in alive:
                alive.add(source)
                stack.append(source)
    return alive
