from __future__ import annotations

import pytest

from guided.errors import ConstraintError
from guided.fsm.compressed import CompressedFSM


def test_forced_chain_and_advance():
    fsm = CompressedFSM.from_regex(r'\{"name": "[a-z]+"\}')
    assert fsm.forced_from(fsm.initial) == '{"name": "'
    state = fsm.advance(fsm.initial, '{"name": "ab')
    assert state is not None and fsm.forced_from(state) == ""
    state = fsm.advance(state, '"')
    assert fsm.forced_from(state) == "}"
    assert fsm.is_final(fsm.advance(state, "}"))
    assert fsm.advance(fsm.initial, "x") is None


def test_multibyte_alternatives():
    fsm = CompressedFSM.from_regex("(héllo|日本)")
    assert fsm.forced_from(fsm.initial) == ""
    state = fsm.advance(fsm.initial, "h")
    assert fsm.forced_from(state) == "éllo"
    state = fsm.advance(fsm.initial, "日")
    assert fsm.forced_from(state) == "本"
    assert fsm.is_final(fsm.advance(state, "本"))


def test_no_forcing_at_final_or_branch():
    fsm = CompressedFSM.from_regex("ab(c|d)e?")
    assert fsm.forced_from(fsm.initial) == "ab"
    state = fsm.advance(fsm.initial, "abc")
    assert fsm.is_final(state) and fsm.forced_from(state) == ""


def test_dead_branches_do_not_block_forcing():
    fsm = CompressedFSM.from_regex("a(b|[^\\s\\S])c")
    assert fsm.forced_from(fsm.initial) == "abc"


def test_bad_regex():
    with pytest.raises(ConstraintError):
        CompressedFSM.from_regex("(unclosed")
