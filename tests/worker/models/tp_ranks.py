"""Runs a function on N ranks joined through guided.worker.models.parallel's env:// rendezvous on a
free port (gloo on the CPU, NCCL on GPUs, one per rank), in spawned processes with a deadline:
a rank that hangs or dies fails the test instead of hanging it. Each rank's return value comes
back through a file."""
from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 240.0  # the default model on 2 ranks took ~35 s on this busy 2-core box


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, target: Callable[..., Any], world_size: int, port: int, out_dir: str,
               args: tuple, device_type: str) -> None:
    from guided.worker.models.parallel import destroy_distributed, init_distributed, rank_device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # two ranks on a shared 2-core box: no OpenMP spinning
    ctx = init_distributed(rank_device(device_type), timeout_s=TIMEOUT_S / 2)
    try:
        torch.save(target(ctx, *args), Path(out_dir) / f"rank{rank}.pt")
        # every rank done before any tears its process group down: gloo aborted a rank
        # ("terminate called without an active exception") whose peer had already left
        torch.distributed.barrier()
    finally:
        destroy_distributed(ctx)


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any,
              device_type: str = "cpu", timeout_s: float = TIMEOUT_S) -> list[Any]:
    """[target(ctx, *args) on rank r for r in range(world_size)]; target must be a module-level
    function (the spawned ranks import it)."""
    with tempfile.TemporaryDirectory() as out_dir:
        procs = mp.start_processes(_rank_main, args=(target, world_size, free_port(), out_dir,
                                                      args, device_type),
                                   nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not procs.join(timeout=1.0):  # raises at once if a rank fails
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks did not finish in {timeout_s:.0f} s")
        finally:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]
