"""Tensor-parallel ranks: one process per device joined through torch.distributed over an env://
rendezvous (MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE, as torchrun sets them), NCCL on GPUs
and gloo on the CPU; the collectives the sharded model runs."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# a rank that never arrives (died before the rendezvous, wrong MASTER_PORT) fails the others'
# start after this long instead of hanging them
INIT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this process sits among the tensor-parallel ranks. group None: the default group
    (or no group at all, at world size 1, where the model runs no collective)."""
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x is returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world_size, *x.shape): every rank's x, rank-major; the same shape on every rank."""
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        # the concatenated form (gloo takes no stacked output); all_gather_into_tensor, which
        # the GPU image's torch 2.11 has (all_gather_single is newer) and gloo takes too
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, *x.shape)

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the KV blocks every rank has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device(self))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = ParallelContext()


def env_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the environment torchrun (or the engine) sets; a
    process without them is rank 0 of 1."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    return rank, world_size, local_rank


def rank_device(device_type: str) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK on GPUs (one GPU per rank), else the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", env_rank()[2])
    return torch.device(device_type)


def init_distributed(device: torch.device, *, timeout_s: float = INIT_TIMEOUT_S
                     ) -> ParallelContext:
    """Join the ranks named by the environment (env_rank); at world size 1 nothing is set up
    and SINGLE comes back. device: this rank's (rank_device), which picks the backend."""
    rank, world_size, _ = env_rank()
    if world_size == 1:
        return SINGLE
    if device.type == "cuda":
        # NVLink SHARP (multicast) all-reduce: off; the lent machines' README says why. NCCL
        # reads it when its communicator is created, so it must be set before the first collective
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
    talks to it can abort that peer (seen with gloo: std::terminate, SIGABRT)."""
    if ctx.world_size > 1 and dist.is_initialized():
        dist.barrier(group=ctx.group)
        dist.destroy_process_group()


def _collective_device(ctx: ParallelContext) -> torch.device:
    # NCCL moves device tensors only; gloo host tensors
    if dist.get_backend(ctx.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
