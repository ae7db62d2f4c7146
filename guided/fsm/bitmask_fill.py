"""Fill many requests' bitmask rows at once: serial for small batches, threads for large ones.

xgrammar's fill_next_token_bitmask releases the GIL, so rows fill in parallel threads. A thread
hand-off costs ~20-40 µs per task on these machines while one row fills in ~40-60 µs, so below
PARALLEL_THRESHOLD rows the serial loop is faster (see benchmarks/bench_grammar.py).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from guided.fsm.matcher import Matcher

PARALLEL_THRESHOLD = 8

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _get_pool(num_threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size != num_threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="bitmask")
            _pool_size = num_threads
        return _pool


def fill_bitmasks(items: list[tuple[Matcher, int]], bitmask: torch.Tensor, *,
                  num_threads: int, min_parallel_rows: int = PARALLEL_THRESHOLD) -> None:
    """bitmask: int32 (N, ceil(vocab_size / 32)) on the CPU; items: (matcher, row) pairs."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError("bitmask must be a 2-D int32 CPU tensor")
    if num_threads <= 1 or len(items) < max(2, min_parallel_rows):
        for matcher, row in items:
            matcher.fill_bitmask(bitmask, row)
        return
    # one contiguous chunk of rows per thread: fewer hand-offs than one task per row
    num_chunks = min(num_threads, len(items))
    chunks = [items[i::num_chunks] for i in range(num_chunks)]

    def fill(chunk: list[tuple[Matcher, int]]) -> None:
        for matcher, row in chunk:
            matcher.fill_bitmask(bitmask, row)

    for future in [_get_pool(num_threads).submit(fill, c) for c in chunks]:
        future.result()
