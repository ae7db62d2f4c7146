"""Logprobs in OpenAI's formats: a token's bytes and text as OpenAI shows them, and the
logprobs of chat and completion choices."""
from __future__ import annotations

from guided.fsm.vocab import gpt2_byte_decoder
from guided.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


class TokenTexts:
    """Token id -> its bytes and text, as OpenAI's logprobs show them (cached per id)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_of = gpt2_byte_decoder()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            data = b""
        elif token_id in self._special or not all(c in self._byte_of for c in piece):
            data = self._tokenizer.decode([token_id]).encode("utf-8")
        else:
            data = bytes(self._byte_of[c] for c in piece)
        self._cache[token_id] = data
        return data

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(entries, texts: TokenTexts, num_top: int) -> ChatLogprobs:
    """`entries`: guided.outputs.TokenLogprob list -> choices[i].logprobs of a chat response."""
    content = []
    for e in entries:
        top = [TopLogprob(token=texts.text(t), logprob=lp, bytes=list(texts.bytes(t)))
               for t, lp in e.top[:num_top]]
        content.append(ChatTokenLogprob(token=texts.text(e.token_id), logprob=e.logprob,
                                        bytes=list(texts.bytes(e.token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(entries, texts: TokenTexts, num_top: int, offset: int
                        ) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        token = texts.text(e.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({texts.text(t): lp for t, lp in e.top[:num_top]})
        out.text_offset.append(offset)
        offset += len(token)
    return out
