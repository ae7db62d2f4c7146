"""The tokenizer's vocabulary as raw bytes per token id: the one view every grammar backend shares."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPM_SPACE = "\u2581"  # ▁


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable unicode table (bytes_to_unicode), inverted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    byte_values, code_points = printable[:], printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            code_points.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(byte_values, code_points)}


@dataclass(frozen=True, eq=False)  # compared by identity: vocabularies are big
class TokenVocab:
    """token_bytes[i] is the byte string token i decodes to (b"" for special tokens, which no
    grammar may produce); vocab_size is the model's logits width, possibly wider than the table."""

    token_bytes: list[bytes]
    eos_token_ids: tuple[int, ...]
    special_ids: frozenset[int]
    vocab_size: int

    def __post_init__(self) -> None:
        if self.vocab_size < len(self.token_bytes):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's "
                             f"{len(self.token_bytes)} tokens")

    @staticmethod
    def from_tokenizer(tokenizer, vocab_size: int | None = None) -> TokenVocab:
        """Decode a Hugging Face tokenizer's tokens to bytes: byte-level BPE (GPT-2 byte table)
        or sentencepiece style (▁ for space, <0xNN> byte tokens)."""
        num_tokens = len(tokenizer)
        pieces: list[str | None] = [None] * num_tokens
        for piece, token_id in tokenizer.get_vocab().items():
            if 0 <= token_id < num_tokens:
                pieces[token_id] = piece
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special_ids.add(int(token_id))
        byte_level = _looks_byte_level(pieces, special_ids)
        token_bytes = []
        for token_id, piece in enumerate(pieces):
            if piece is None or token_id in special_ids:
                special_ids.add(token_id)
                token_bytes.append(b"")
            elif byte_level:
                token_bytes.append(_decode_byte_level(piece))
            else:
                token_bytes.append(_decode_sentencepiece(piece))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos token: grammars need one to end")
        return TokenVocab(token_bytes=token_bytes, eos_token_ids=(int(eos),),
                          special_ids=frozenset(special_ids),
                          vocab_size=max(vocab_size or 0, num_tokens))


def _looks_byte_level(pieces: list[str | None], special_ids: set[int]) -> bool:
    table = gpt2_byte_decoder()
    normal = [p for i, p in enumerate(pieces) if p is not None and i not in special_ids]
    if any(_SPM_SPACE in p for p in normal[:5000]) and not any("Ġ" in p for p in normal[:5000]):
        return False
    return all(ch in table for p in normal for ch in p)


def _decode_byte_level(piece: str) -> bytes:
    table = gpt2_byte_decoder()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:  # an added non-special token written as plain text
        return piece.encode("utf-8")


def _decode_sentencepiece(piece: str) -> bytes:
    match = _SPM_BYTE.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SPM_SPACE, " ").encode("utf-8")
