"""CUDA graphs of the forward pass, so a step costs one launch instead of hundreds:

- decode graphs (one new token per request), one per padded batch size, split-K kernel;
- verify graphs (the last sampled token plus drafts, <= MAX_QUERY_LEN per request), one per
  padded token count, split-K kernel;
- prefill graphs (any query lengths, mixed with decoding requests), one per padded token count,
  on the varlen kernel: under continuous batching nearly every arrival costs such a step.

Padding never touches a request's cache: padding tokens write to a scratch block no request
owns, and padding requests read only that block."""
from __future__ import annotations

import logging
import time

import torch

from guided.worker.models.llama import AttentionMetadata

log = logging.getLogger(__name__)

MAX_QUERY_LEN = 8  # tokens per request in a verify graph: 1 + up to 7 drafts
MAX_VERIFY_TOKENS = 2048  # verify and prefill graphs cover steps of up to this many tokens
PREFILL_PAD = 128  # tokens per padding request in a prefill graph (within any block table)


def decode_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_batch] or [1]


def _up_to(counts: list[int], max_tokens: int) -> list[int]:
    return [c for c in counts if c <= max(min(max_tokens, MAX_VERIFY_TOKENS), 8)]


def prefill_token_counts(max_tokens: int) -> list[int]:
    return _up_to([8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048], max_tokens)


def verify_token_counts(max_tokens: int) -> list[int]:
    """Finer than the prefill ladder: a verify step is mostly a decode batch with a few drafts,
    and every padding token runs through every layer (benchmarks/bench_graph_sizes.py)."""
    return _up_to([8, *range(16, 513, 16), *range(544, 1025, 32), 1280, 1536, 1792, 2048],
                  max_tokens)


class StepGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device,
                 max_step_tokens: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.decode_sizes = decode_batch_sizes(max_batch)
        self.verify_sizes = verify_token_counts(max_batch * MAX_QUERY_LEN)
        self.prefill_sizes = [c for c in prefill_token_counts(max_step_tokens)
                              if MAX_QUERY_LEN < c <= max_step_tokens]
        # a verify request may run MAX_QUERY_LEN tokens past its last block
        self.max_blocks = max_blocks_per_seq
        width = max_blocks_per_seq + MAX_QUERY_LEN // block_size + 1
        self.prefill_pad = min(PREFILL_PAD, width * block_size)  # its blocks fit a table row
        # request slots of a prefill graph: the batch, then its padding requests
        self.prefill_slots = (max_batch + -(-self.prefill_sizes[-1] // self.prefill_pad)
                              if self.prefill_sizes else 0)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = max(self.decode_sizes[-1], self.verify_sizes[-1], *self.prefill_sizes,
                self.prefill_slots)
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
        slots = self._prefill_slots(n) if kind == "prefill" else n
        max_query_len = {"decode": 1, "verify": MAX_QUERY_LEN, "prefill": n}[kind]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:slots],
            query_start_loc=query_start_loc[:slots + 1], seq_lens=self.seq_lens[:slots],
            max_query_len=max_query_len, max_seq_len=self.max_seq_len, use_triton=True)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        warm = 0.0
        warmed: set[str] = set()
        pool = None
        keys = ([("prefill", n) for n in reversed(self.prefill_sizes)]
                + [("verify", n) for n in reversed(self.verify_sizes)]
                + [("decode", n) for n in reversed(self.decode_sizes)])
        for key in keys:  # largest first: smaller graphs reuse the memory pool
            kind, n = key
            log.debug("capturing the %s graph of %d", kind, n)
            args = (self.input_ids[:n], self.positions[:n], self.kv_caches, self._meta(kind, n))
            t_warm = time.perf_counter()
            # compile / autotune outside the capture: twice for a kind's first graph, then once
            for _ in range(1 if kind in warmed else 2):
                self.model(*args, fused=True)
            warmed.add(kind)
            torch.cuda.synchronize()
            warm += time.perf_counter() - t_warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.model(*args, fused=True)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (decode batch <= %d, verify tokens <= %d, prefill "
                 "tokens <= %d) in %.1f s (%.1f s of it in warm-up passes)", len(self.graphs),
                 self.decode_sizes[-1], self.verify_sizes[-1],
                 self.prefill_sizes[-1] if self.prefill_sizes else 0, time.perf_counter() - t0,
                 warm)

    def pick(self, meta: AttentionMetadata, num_tokens: int, *, has_drafts: bool = True
             ) -> tuple[str, int] | None:
        """The (kind, padded size) of the graph that can run this step, or None (eager)."""
        num_reqs = meta.seq_lens.shape[0]
        if meta.block_tables.shape[1] > self.max_blocks:
            return None
        if meta.max_query_len == 1 and num_tokens == num_reqs:
            size = next((s for s in self.decode_sizes if s >= num_reqs), None)
            return None if size is None else ("decode", size)
        if has_drafts and meta.max_query_len <= MAX_QUERY_LEN:
            size = next((s for s in self.verify_sizes if s >= num_tokens), None)
            if size is not None:
                return ("verify", size)
        size = next((s for s in self.prefill_sizes if s >= num_tokens), None)
        if size is None:
            return None
        num_padding = -(-(size - num_tokens) // self.prefill_pad)
        return ("prefill", size) if num_reqs + num_padding <= self._prefill_slots(size) else None

    def _prefill_slots(self, num_tokens: int) -> int:
        """No more request slots than tokens: every slot's query then lies inside them."""
        return min(self.prefill_slots, num_tokens)

    def run(self, key: tuple[str, int], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        kind, padded = key
        t, b = input_ids.shape[0], meta.seq_lens.shape[0]
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
        elif kind == "verify":
            self._pad_varlen(meta, t, b, padded, chunk=MAX_QUERY_LEN, slots=padded)
        else:
            self._pad_varlen(meta, t, b, padded, chunk=self.prefill_pad,
                             slots=self._prefill_slots(padded))
        self.graphs[key].replay()
        return self.outputs[key][:t]

    def _pad_varlen(self, meta: AttentionMetadata, t: int, b: int, padded: int, *,
                    chunk: int, slots: int) -> None:
        """Padding tokens t..padded go to padding requests of <= chunk tokens each over the
        scratch block; the remaining of the graph's request slots get no tokens."""
        self.query_start_loc[:b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.slot_mapping[t:padded].fill_(self.scratch_slot)
        self.positions[t:padded].zero_()
        starts = list(range(t, padded, chunk))  # one padding request per chunk
        ends = starts[1:] + [padded] if starts else []
        tail = ends + [padded] * (slots - b - len(ends))  # then requests with no tokens
        self.query_start_loc[b + 1:slots + 1].copy_(torch.tensor(tail, dtype=torch.int32),
                                                   non_blocking=True)
        lens = [e - s for s, e in zip(starts, ends)] + [1] * (slots - b - len(starts))
        self.seq_lens[b:slots].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[b:slots, :-(-chunk // self.block_size)].fill_(self.scratch_block)
