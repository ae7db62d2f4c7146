"""Megatron-style tensor parallelism for the llama family: which slice of each weight a rank
holds (ShardLayout), and the layers whose outputs the ranks combine.

    column-parallel (qkv, gate_up): each rank computes its own output columns; no collective
    row-parallel (o, down):         each rank a partial sum over its input columns; all-reduce
    vocab-parallel embedding:       each rank looks up the ids in its vocab slice; all-reduce
    vocab-parallel LM head:         each rank its vocab slice of the logits; all-gather

At world size 1 the model is built of plain nn.Linear / nn.Embedding (the factories below), so
it runs exactly the code it ran before tensor parallelism: no collective, no extra copy."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from guided.worker.distributed import ParallelContext
from guided.worker.model_config import ModelConfig


def split_range(size: int, rank: int, world_size: int) -> range:
    """rank's contiguous part of range(size): sizes differ by at most one, larger parts first."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank holds of a llama-family model (global indices)."""
    rank: int
    world_size: int
    q_heads: range  # the query heads this rank attends with
    kv_heads: range  # the KV heads they read: this rank's KV cache holds exactly these
    intermediate: range  # its columns of the MLP's intermediate activation
    vocab: range  # the vocab rows it holds of the embedding / LM head (may be short or empty)
    vocab_rows: int  # rows of its embedding / LM head, equal on every rank (the gather's width)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def shard_layout(cfg: ModelConfig, rank: int, world_size: int) -> ShardLayout:
    """KV heads are split between the ranks, each with the query heads that read it; with fewer
    KV heads than ranks, the query heads are split and each rank holds a copy of the one KV head
    its query heads read (vLLM's replication). Uneven splits are allowed where they keep every
    rank's query heads on whole KV groups (the default model's 3 KV heads over 2 ranks)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads >= world_size:
        kv_heads = split_range(cfg.num_kv_heads, rank, world_size)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:
        if world_size % cfg.num_kv_heads or cfg.num_heads % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} cannot split {cfg.name}'s attention: with "
                f"fewer KV heads ({cfg.num_kv_heads}) than ranks it must be a multiple of them "
                f"and divide the {cfg.num_heads} query heads; at most {cfg.num_kv_heads} ranks "
                "split it otherwise")
        q_heads = split_range(cfg.num_heads, rank, world_size)
        first = q_heads.start // group
        kv_heads = range(first, first + 1)
    if cfg.intermediate_size < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds {cfg.name}'s MLP width")
    vocab_rows = -(-cfg.vocab_size // world_size)
    start = min(rank * vocab_rows, cfg.vocab_size)
    return ShardLayout(rank, world_size, q_heads, kv_heads,
                       split_range(cfg.intermediate_size, rank, world_size),
                       range(start, min(start + vocab_rows, cfg.vocab_size)), vocab_rows)


class RowParallelLinear(nn.Linear):
    """y = x_local @ W[:, local columns]^T, summed over the ranks. No bias: the llama family's
    row-parallel projections (o, down) have none, and a bias would be added once, not per rank."""

    def __init__(self, local_in_features: int, out_features: int, ctx: ParallelContext):
        super().__init__(local_in_features, out_features, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds vocab rows [start, start + vocab_rows); an id outside them reads zeros,
    and the ranks' lookups are summed (exactly one rank holds each id)."""

    def __init__(self, layout: ShardLayout, hidden_size: int, ctx: ParallelContext):
        super().__init__(layout.vocab_rows, hidden_size)
        self.vocab_start = layout.vocab.start
        self.num_local = len(layout.vocab)  # rows past it pad the last rank's slice
        self.ctx = ctx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)  # (T,) shape-static: graph-safe
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, H)
        return self.ctx.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


def row_parallel_linear(local_in_features: int, out_features: int, ctx: ParallelContext
                        ) -> nn.Linear:
    if ctx.world_size == 1:
        return nn.Linear(local_in_features, out_features, bias=False)
    return RowParallelLinear(local_in_features, out_features, ctx)


def vocab_embedding(layout: ShardLayout, hidden_size: int, ctx: ParallelContext) -> nn.Embedding:
    if ctx.world_size == 1:
        return nn.Embedding(layout.vocab_rows, hidden_size)
    return VocabParallelEmbedding(layout, hidden_size, ctx)


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                  ctx: ParallelContext) -> torch.Tensor:
    """hidden (N, H) x this rank's vocab rows (vocab_rows, H) -> the full logits (N, vocab_size)
    on every rank: every rank masks and samples the same rows identically."""
    local = F.linear(hidden, weight)  # (N, Vr)
    parts = ctx.all_gather(local)  # (W, N, Vr)
    logits = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)  # (N, W * Vr)
    if logits.shape[1] == vocab_size:
        return logits
    return logits[:, :vocab_size].contiguous()  # the last rank's padding rows
