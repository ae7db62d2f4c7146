"""outlines-core backend: choice (and regex) constraints on a token-level regex index."""
from __future__ import annotations

import codecs
import json

import outlines_core as oc
import torch

from guided.errors import ConstraintError
from guided.fsm.compressed import CompressedFSM
from guided.fsm.matcher import MAX_ROLLBACK_TOKENS, Matcher
from guided.fsm.vocab import TokenVocab

_RUST_REGEX_META = set(r"\.+*?()|[]{}^$#&-~ ")


def escape_literal(text: str) -> str:
    """Escape text for both outlines-core's (Rust) and interegular's (Python) regex syntax."""
    return "".join("\\" + c if c in _RUST_REGEX_META else c for c in text)


def choice_regex(options: list[str]) -> str:
    return "(" + "|".join(escape_literal(o) for o in options) + ")"


class OutlinesIndex:
    """A compiled outlines-core Index plus the char-level FSM used for forced strings."""

    def __init__(self, index: oc.Index, fsm: CompressedFSM, pattern: str):
        self.index = index
        self.fsm = fsm
        self.pattern = pattern


class OutlinesBackend:
    name = "outlines"

    def __init__(self, vocab: TokenVocab):
        self.vocab = vocab
        token_map: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(vocab.token_bytes):
            if data and token_id not in vocab.special_ids:
                token_map.setdefault(data, []).append(token_id)
        eos = vocab.eos_token_ids[0]
        self.vocabulary = oc.Vocabulary(eos, token_map)
        # single-byte tokens let accept_bytes walk the index a byte at a time
        self.byte_token = {data[0]: ids[0] for data, ids in token_map.items() if len(data) == 1}

    def compile_choice(self, choices_json: str) -> OutlinesIndex:
        options = json.loads(choices_json)
        return self.compile_regex(choice_regex(options))

    def compile_regex(self, pattern: str) -> OutlinesIndex:
        fsm = CompressedFSM.from_regex(pattern)
        try:
            index = oc.Index(pattern, self.vocabulary)
        except Exception as e:  # outlines-core raises ValueError on bad or empty regexes
            raise ConstraintError(f"cannot compile regex {pattern!r}: {e}") from None
        return OutlinesIndex(index, fsm, pattern)


class OutlinesMatcher(Matcher):
    """Token-level state from the outlines Guide, plus a char-level FSM state and a buffer of
    pending bytes (a token may end inside a UTF-8 character) for forced strings. The history of
    (char state, pending bytes) mirrors the Guide's own rollback window."""

    def __init__(self, compiled: OutlinesIndex, backend: OutlinesBackend):
        self._guide = oc.Guide(compiled.index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._index = compiled.index
        self._fsm = compiled.fsm
        self._vocab = backend.vocab
        self._byte_token = backend.byte_token
        self._eos = set(backend.vocab.eos_token_ids)
        self._terminated = False
        self._char_state: int | None = compiled.fsm.initial
        self._pending = b""
        # per accepted token: (char state, pending bytes, terminated) before it, and was-it-EOS
        self._history: list[tuple[int | None, bytes, bool, bool]] = []

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._eos:
            if not self._index.is_final_state(self._guide.get_state()):
                return False
            self._push(eos=True)  # the Guide has no EOS transition: only we record it
            self._terminated = True
            return True
        if not 0 <= token_id < len(self._vocab.token_bytes) or token_id in self._vocab.special_ids:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:
            return False
        self._push()  # the state before this token
        self._advance_chars(self._vocab.token_bytes[token_id])
        return True

    def _push(self, eos: bool = False) -> None:
        self._history.append((self._char_state, self._pending, self._terminated, eos))
        if len(self._history) > MAX_ROLLBACK_TOKENS:
            del self._history[0]

    def _advance_chars(self, data: bytes) -> None:
        if self._char_state is None:
            return
        data = self._pending + data
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        try:
            text = decoder.decode(data, final=False)
        except UnicodeDecodeError:
            self._char_state = None
            return
        self._pending = decoder.getstate()[0]
        self._char_state = self._fsm.advance(self._char_state, text)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]  # (ceil(vocab_size / 32),)
        if self._terminated:
            target.zero_()
            return
        if not target.is_contiguous() or bitmask.dtype != torch.int32:
            raise ValueError("fill_bitmask needs an int32 bitmask with contiguous rows")
        self._guide.write_mask_into(target.data_ptr(), target.numel(), 4)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._history)} "
                             f"are kept")
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        self._char_state, self._pending, self._terminated, _ = undone[0]
        guide_tokens = sum(1 for entry in undone if not entry[3])
        if guide_tokens:
            self._guide.rollback_state(guide_tokens)

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_string(self) -> bytes:
        if self._terminated or self._char_state is None:
            return b""
        state = self._char_state
        prefix = b""
        if self._pending:
            # finish the character begun by the last token, if only one can follow
            candidates = [c for c in self._fsm.transitions.get(state, {})
                          if c.encode("utf-8").startswith(self._pending)]
            if len(candidates) != 1 or state in self._fsm.any_char:
                return b""
            prefix = candidates[0].encode("utf-8")[len(self._pending):]
            state = self._fsm.step(state, candidates[0])
        return prefix + self._fsm.forced_from(state).encode("utf-8")

    def accept_bytes(self, data: bytes) -> bool:
        if self._terminated:
            return False
        token_ids = [self._byte_token.get(b) for b in data]
        if any(t is None for t in token_ids) or not self._guide.accepts_tokens(token_ids):
            return False
        for token_id in token_ids:
            self.accept_token(token_id)
        return True
