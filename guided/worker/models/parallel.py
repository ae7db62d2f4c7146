"""Megatron-style tensor parallelism for the llama family: the ranks (one process per device,
joined over env:// as torchrun sets it; NCCL on GPUs, gloo on the CPU), which slice of each
weight a rank holds (ShardLayout), and the layers whose outputs the ranks combine.

    column-parallel (qkv, gate_up): each rank computes its own output columns; no collective
    row-parallel (o, down):         each rank a partial sum over its input columns; all-reduce
    vocab-parallel embedding:       each rank looks up the ids in its vocab slice; all-reduce
    vocab-parallel LM head:         each rank its vocab slice of the logits; all-gather

At world size 1 the model is built of plain nn.Linear / nn.Embedding: no collective, no copy."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from guided.worker.model_config import ModelConfig

# a rank that never arrives fails the others' start after this long instead of hanging them
INIT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this process sits among the ranks (group None: the default group, or none)."""
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world_size, *x.shape): every rank's x, rank-major."""
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        # the concatenated form: gloo takes no stacked output
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, *x.shape)

    def all_min(self, value: int) -> int:
        # NCCL moves device tensors only; gloo host tensors
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = ParallelContext()


def env_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun sets them; without them, rank 0 of 1."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    return rank, world_size, local_rank


def rank_device(device_type: str) -> torch.device:
    """cuda:LOCAL_RANK on GPUs (one GPU per rank), else the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", env_rank()[2])
    return torch.device(device_type)


def init_distributed(device: torch.device, *, timeout_s: float = INIT_TIMEOUT_S
                     ) -> ParallelContext:
    """Join the ranks named by the environment (SINGLE at world size 1); device (rank_device)
    picks the backend."""
    rank, world_size, _ = env_rank()
    if world_size == 1:
        return SINGLE
    if device.type == "cuda":
        # NVLink SHARP (multicast) off, as the lent machines need; read at the first collective
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
        backend, device_id = "nccl", device
    else:
        backend, device_id = "gloo", None
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return ParallelContext(rank, world_size, dist.group.WORLD)


def destroy_distributed(ctx: ParallelContext) -> None:
    """Leave the group together: a rank that tears its connections down while a peer still
    talks to it can abort that peer (gloo: SIGABRT)."""
    if ctx.world_size > 1 and dist.is_initialized():
        dist.barrier(group=ctx.group)
        dist.destroy_process_group()


def split_range(size: int, rank: int, world_size: int) -> range:
    """rank's contiguous part of range(size), larger parts first."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank holds of a llama-family model (global indices)."""
    q_heads: range  # the query heads this rank attends with
    kv_heads: range  # the KV heads they read: this rank's KV cache holds exactly these
    intermediate: range  # its columns of the MLP's intermediate activation
    vocab: range  # the vocab rows it holds of the embedding / LM head (may be short or empty)
    vocab_rows: int  # rows of its embedding / LM head, equal on every rank (the gather's width)


def shard_layout(cfg: ModelConfig, rank: int, world_size: int) -> ShardLayout:
    """KV heads are split between the ranks, each with the query heads that read it; with fewer
    KV heads than ranks, the query heads are split and each rank holds a copy of the one KV head
    they read (vLLM's replication). Uneven splits keep every rank's query heads on whole groups."""
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
    return ShardLayout(q_heads, kv_heads, split_range(cfg.intermediate_size, rank, world_size),
                       range(start, min(start + vocab_rows, cfg.vocab_size)), vocab_rows)


class RowParallelLinear(nn.Linear):
    """y = x_local @ W[:, local columns]^T, summed over the ranks (o and down have no bias)."""

    def __init__(self, local_in_features: int, out_features: int, ctx: ParallelContext):
        super().__init__(local_in_features, out_features, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """An id outside this rank's vocab rows reads zeros; the ranks' lookups are summed."""

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
    """hidden (N, H) x this rank's vocab rows (Vr, H) -> the full logits (N, V) on every rank."""
    local = F.linear(hidden, weight)  # (N, Vr)
    parts = ctx.all_gather(local)  # (W, N, Vr)
    logits = parts.permute(1, 0, 2).reshape(hidden.shape[0], -1)  # (N, W * Vr)
    if logits.shape[1] == vocab_size:
        return logits
    return logits[:, :vocab_size].contiguous()  # the last rank's padding rows
