"""server/jobs.py: tokens' bytes and text as OpenAI shows them, and logprobs of choices."""
from __future__ import annotations

from guided.outputs import TokenLogprob
from guided.server.jobs import TokenTexts, chat_logprobs, completion_logprobs


class _Tok:
    """Byte-level pieces: 'Ġ' is the space byte, 'Ã©' are the two bytes of 'é'."""
    def __init__(self):
        self.all_special_ids = [0]
        self.pieces = {0: "<s>", 1: "Ġhi", 2: "Ã", 3: "©"}

    def convert_ids_to_tokens(self, i):
        return self.pieces[i]

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_token_texts_bytes():
    t = TokenTexts(_Tok())
    assert t.bytes(1) == b" hi" and t.text(1) == " hi"
    assert t.bytes(2) + t.bytes(3) == "é".encode()
    assert t.text(2) == "\ufffd"
    assert t.bytes(0) == b"<s>"


def test_chat_and_completion_logprobs():
    t = TokenTexts(_Tok())
    entries = [TokenLogprob(1, -0.1, [(1, -0.1), (0, -3.0)])]
    c = chat_logprobs(entries, t, 1)
    assert c.content[0].token == " hi" and c.content[0].bytes == list(b" hi")
    assert [x.token for x in c.content[0].top_logprobs] == [" hi"]
    lp = completion_logprobs(entries, t, 2, offset=5)
    assert lp.tokens == [" hi"] and lp.text_offset == [5]
    assert lp.top_logprobs == [{" hi": -0.1, "<s>": -3.0}]
