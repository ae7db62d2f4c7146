"""A request's prompt as token ids, checked against the vocabulary and the context length; the
tokens that end a chat turn."""
from __future__ import annotations

from guided.errors import InvalidRequestError


def prompt_token_ids(tokenizer, prompt: str | list[int], *, vocab_size: int,
                     max_model_len: int) -> list[int]:
    """Text is tokenized without special tokens (chat templates add their own); a list must
    be token ids inside the vocabulary. Raises InvalidRequestError naming the problem."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids",
                                  param="prompt")
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens; this model's context is {max_model_len} tokens "
            "(the prompt must leave room for at least one output token)", param="prompt")
    return ids


def eos_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS, and <|im_end|> where the vocabulary has it (ChatML models end their
    turns with it)."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return tuple(sorted(i for i in ids if i is not None))
