"""CUDA graphs of the forward pass, so a step costs one launch instead of hundreds:

- decode graphs (every request has one new token), one per padded batch size, on the split-K
  decode kernel;
- verify graphs (every request has 1..MAX_QUERY_LEN tokens: the last sampled token plus
  jump-forward drafts), one per padded token count, on the varlen kernel. Without them a step
  with drafts would fall back to eager launches, which costs more than the drafts save.

Padding never touches a request's cache: padding tokens write to a scratch block no request
owns, and padding requests (at most MAX_QUERY_LEN tokens each) read only that block.
"""
from __future__ import annotations

import logging
import time

import torch

from guided.worker.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)

MAX_QUERY_LEN = 8  # tokens per request in a verify graph: 1 + up to 7 drafts
MAX_VERIFY_TOKENS = 2048  # verify graphs cover steps of up to this many tokens


def decode_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_batch] or [1]


def verify_token_counts(max_tokens: int) -> list[int]:
    counts = [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    return [c for c in counts if c <= max(min(max_tokens, MAX_VERIFY_TOKENS), 8)]


class StepGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.decode_sizes = decode_batch_sizes(max_batch)
        self.verify_sizes = verify_token_counts(max_batch * MAX_QUERY_LEN)
        # a verify request may run MAX_QUERY_LEN tokens past its last block
        self.max_blocks = max_blocks_per_seq
        width = max_blocks_per_seq + MAX_QUERY_LEN // block_size + 1
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = max(self.decode_sizes[-1], self.verify_sizes[-1])
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)  # (T,)
            self.positions = torch.zeros(n, dtype=torch.int64)  # (T,)
            self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64)  # (T,)
            self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32)
            self.seq_lens = torch.ones(n, dtype=torch.int32)  # (B,)
            # decode graphs read a constant arange; verify replays rewrite their own copy
            self.decode_query_start_loc = torch.arange(n + 1, dtype=torch.int32)  # (B + 1,)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)  # (B + 1,)
        self.max_seq_len = width * block_size
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._capture_all()

    def _meta(self, kind: str, n: int) -> AttentionMetadata:
        query_start_loc = (self.decode_query_start_loc if kind == "decode"
                           else self.query_start_loc)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
            query_start_loc=query_start_loc[:n + 1], seq_lens=self.seq_lens[:n],
            max_query_len=1 if kind == "decode" else MAX_QUERY_LEN,
            max_seq_len=self.max_seq_len, use_triton=True)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = None
        keys = ([("verify", n) for n in reversed(self.verify_sizes)]
                + [("decode", n) for n in reversed(self.decode_sizes)])
        for key in keys:  # largest first: smaller graphs reuse the memory pool
            kind, n = key
            args = (self.input_ids[:n], self.positions[:n], self.kv_caches, self._meta(kind, n))
            for _ in range(2):  # compile / autotune outside the capture
                self.model(*args, fused=True)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.model(*args, fused=True)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (decode batch <= %d, verify tokens <= %d) in %.1f s",
                 len(self.graphs), self.decode_sizes[-1], self.verify_sizes[-1],
                 time.perf_counter() - t0)

    def pick(self, meta: AttentionMetadata, num_tokens: int, *, has_drafts: bool = True
             ) -> tuple[str, int] | None:
        """The graph that can run this step, or None (eager). Verify graphs serve steps with
        jump-forward drafts only (short prefills after a prefix hit run eagerly)."""
        num_reqs = meta.seq_lens.shape[0]
        if meta.block_tables.shape[1] > self.max_blocks or meta.max_query_len > MAX_QUERY_LEN:
            return None
        if meta.max_query_len == 1 and num_tokens == num_reqs:
            size = next((s for s in self.decode_sizes if s >= num_reqs), None)
            return None if size is None else ("decode", size)
        if not has_drafts:
            return None
        size = next((s for s in self.verify_sizes if s >= num_tokens), None)
        return None if size is None else ("verify", size)

    def run(self, key: tuple[str, int], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, query_lens: list[int]) -> torch.Tensor:
        kind, padded = key
        t, b = input_ids.shape[0], len(query_lens)
        width = meta.block_tables.shape[1]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        if kind == "decode":
            if padded > b:
                self.slot_mapping[b:padded].fill_(self.scratch_slot)
                self.seq_lens[b:padded].fill_(1)
                self.block_tables[b:padded, 0].fill_(self.scratch_block)
        else:
            self._pad_verify(meta, t, b, padded)
        self.graphs[key].replay()
        return self.outputs[key][:t]

    def _pad_verify(self, meta: AttentionMetadata, t: int, b: int, padded: int) -> None:
        """Padding tokens t..padded go to padding requests of <= MAX_QUERY_LEN tokens each;
        the remaining request slots get no tokens."""
        self.query_start_loc[:b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.slot_mapping[t:padded].fill_(self.scratch_slot)
        self.positions[t:padded].zero_()
        starts = list(range(t, padded, MAX_QUERY_LEN))  # one padding request per chunk
        ends = starts[1:] + [padded] if starts else []
        tail = ends + [padded] * (padded - b - len(ends))  # then requests with no tokens
        self.query_start_loc[b + 1:padded + 1].copy_(torch.tensor(tail, dtype=torch.int32),
                                                    non_blocking=True)
        lens = [min(MAX_QUERY_LEN, padded - s) for s in starts] + [1] * (padded - b - len(starts))
        self.seq_lens[b:padded].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[b:padded, 0].fill_(self.scratch_block)
