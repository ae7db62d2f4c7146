"""The tokenizer's vocabulary as raw bytes per token id, as every grammar backend sees it."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable unicode table, inverted (the server's logprob bytes)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


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
        """A Hugging Face tokenizer's tokens as xgrammar decodes them (byte-level BPE,
        sentencepiece with byte fallback, raw), special tokens and unused ids as b""."""
        import xgrammar as xgr

        num_tokens = len(tokenizer)
        decoded = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=num_tokens)
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
            if getattr(added, "special", False):
                special_ids.add(int(token_id))
        special_ids |= set(range(num_tokens)) - set(tokenizer.get_vocab().values())
        token_bytes = [b"" if i in special_ids else data
                       for i, data in enumerate(decoded.decoded_vocab[:num_tokens])]
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos token: grammars need one to end")
        return TokenVocab(token_bytes=token_bytes, eos_token_ids=(int(eos),),
                          special_ids=frozenset(special_ids),
                          vocab_size=max(vocab_size or 0, num_tokens))
