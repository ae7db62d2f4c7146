"""The padded sizes CUDA graphs are captured at (CPU: the ladders only)."""
from __future__ import annotations

from guided.worker.cuda_graphs import (
    MAX_VERIFY_TOKENS,
    decode_batch_sizes,
    prefill_token_counts,
    verify_token_counts,
)


def padded(sizes: list[int], n: int) -> int:
    return next(s for s in sizes if s >= n)


def test_verify_steps_pad_like_decode_batches():
    """A verify step is a decode batch plus a few drafts: its padding stays as small as a decode
    batch's (a few drafts beside 256 requests must not run as 384 tokens)."""
    sizes = verify_token_counts(256 * 8)
    assert sizes[-1] == MAX_VERIFY_TOKENS
    for n in range(1, 1025):
        assert padded(sizes, n) - n < max(16, n // 8), n
    assert padded(sizes, 260) == 272  # 256 requests, 4 drafts
    decode = decode_batch_sizes(1024)
    assert all(padded(sizes, n) <= max(8, padded(decode, n)) for n in range(1, 1025))


def test_ladders_stop_at_what_a_step_can_hold():
    assert verify_token_counts(4) == [8]
    assert verify_token_counts(64 * 8)[-1] == 512
    assert prefill_token_counts(300)[-1] == 256
    assert sorted(set(verify_token_counts(4096))) == verify_token_counts(4096)
