from __future__ import annotations

from guided.fsm.vocab import TokenVocab


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



def test_sentencepiece_pieces_and_byte_fallback():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581hello": 3, "<0xE6>": 4, "a": 5}
    spm = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    vocab = TokenVocab.from_tokenizer(tokenizer)
    assert vocab.token_bytes == [b"", b"", b"", b" hello", b"\xe6", b"a"]
    assert vocab.special_ids == {0, 1, 2} and vocab.eos_token_ids == (2,)
