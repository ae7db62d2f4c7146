"""The worker as the engine sees it: a step's masks go in as a value (StepMasks) and its tokens
come back (RunnerOutput, through a SampledTokens handle), whichever executor runs it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class StepMasks:
    """A step's grammar masks as a value: the filled bitmask rows (token bans applied), and per
    sampled row the row it reads (-1: unconstrained). To the worker a mask is a tensor."""
    bitmask: torch.Tensor  # (R, ceil(V / 32)) int32 on the host
    mask_rows: list[int]  # (N,)


@dataclass(slots=True)
class RunnerOutput:
    token_ids: list[int]  # (N,) one sampled token per row
    logprobs: list  # (N,) (sampled lp, top-k) per row, or None


class SampledTokens(Protocol):
    """A step's tokens on their way to the host."""

    def result(self) -> RunnerOutput: ...
