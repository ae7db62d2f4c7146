"""Joining the ranks over env:// and the collectives the sharded model runs (2 gloo ranks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from guided.worker.distributed import SINGLE, ParallelContext, env_rank, init_distributed

sys.path.insert(0, str(Path(__file__).parent / "models"))
from tp_ranks import run_ranks  # noqa: E402  (the spawning helper the model tests share)


def test_without_the_environment_a_process_is_rank_0_of_1(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert env_rank() == (0, 1, 0)
    assert init_distributed(torch.device("cpu")) is SINGLE  # no process group at world size 1
    assert not torch.distributed.is_initialized()


def test_a_rank_outside_the_world_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2"):
        env_rank()


def _collectives(ctx: ParallelContext) -> dict:
    x = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * ctx.rank
    return {"rank": ctx.rank, "env": env_rank(), "sum": ctx.all_reduce(x.clone()),
            "gathered": ctx.all_gather(x), "min": ctx.all_min(100 - ctx.rank)}


def test_collectives_on_two_ranks():
    base = torch.arange(6, dtype=torch.float32).view(2, 3)
    for rank, out in enumerate(run_ranks(_collectives, 2)):
        assert out["rank"] == rank and out["env"] == (rank, 2, rank)
        assert torch.equal(out["sum"], 2 * base + 10)
        assert torch.equal(out["gathered"], torch.stack([base, base + 10]))
        assert out["min"] == 99
