"""What crosses the engine/worker boundary, whichever executor runs the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class StepMasks:
    """The filled bitmask rows, and per sampled row the row it reads (-1: unconstrained)."""
    bitmask: torch.Tensor  # (R, ceil(V / 32)) int32 on the host
    mask_rows: list[int]  # (N,)


@dataclass(slots=True)
class RunnerOutput:
    token_ids: list[int]  # (N,) one sampled token per row
    logprobs: list  # (N,) (sampled lp, top-k) per row, or None


class SampledTokens(Protocol):
    def result(self) -> RunnerOutput: ...
