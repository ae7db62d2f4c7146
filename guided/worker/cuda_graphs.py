"""CUDA graphs of the decode forward pass: one per padded batch size, replayed with the step's
inputs copied into static buffers, so a decode step costs one launch instead of hundreds.

Padding rows point at a scratch block that no request owns, so their K/V writes are harmless.
"""
from __future__ import annotations

import logging
import time

import torch

from guided.worker.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_batch] or [1]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.scratch_block = scratch_block
        n = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)  # (B,)
            self.positions = torch.zeros(n, dtype=torch.int64)  # (B,)
            self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64)
            self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block,
                                           dtype=torch.int32)  # (B, max_blocks)
            self.seq_lens = torch.ones(n, dtype=torch.int32)  # (B,)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)  # (B + 1,)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size, use_triton=True)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            for _ in range(2):  # warm up: triton autotuning/compilation outside the capture
                self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs),
                 self.sizes[-1], time.perf_counter() - t0)

    def padded_size(self, batch: int) -> int | None:
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def can_run(self, batch: int, max_blocks: int) -> bool:
        return batch <= self.sizes[-1] and max_blocks <= self.max_blocks

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor:
        b = input_ids.shape[0]
        padded = self.padded_size(b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        if padded > b:  # padding rows: scratch block, length 1
            self.slot_mapping[b:padded].fill_(self.scratch_block * self.block_size)
            self.seq_lens[b:padded].fill_(1)
            self.block_tables[b:padded, 0].fill_(self.scratch_block)
        self.graphs[padded].replay()
        return self.outputs[padded][:b]
