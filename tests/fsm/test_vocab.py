from __future__ import annotations

from guided.fsm.vocab import TokenVocab, _decode_sentencepiece


def test_byte_level_roundtrip(tokenizer, vocab):
    text = 'héllo 日本 {"a": [1, 2]}\n\t😀'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode("utf-8")


def test_special_tokens_and_eos(vocab):
    assert len(vocab.token_bytes) == 49152 and vocab.vocab_size == 49152
    assert vocab.eos_token_ids == (2,)
    assert set(range(17)) <= vocab.special_ids
    assert all(vocab.token_bytes[i] == b"" for i in vocab.special_ids)
    assert all(vocab.token_bytes[i] for i in range(17, 49152))


def test_padded_vocab_size(tokenizer):
    vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size=49216)
    assert vocab.vocab_size == 49216 and len(vocab.token_bytes) == 49152


def test_single_bytes_present(vocab):
    singles = {t for t in vocab.token_bytes if len(t) == 1}
    assert all(bytes([b]) in singles for b in range(0x20, 0x7F))  # printable ASCII


def test_sentencepiece_pieces():
    assert _decode_sentencepiece("\u2581hello") == b" hello"
    assert _decode_sentencepiece("<0xE6>") == b"\xe6"
