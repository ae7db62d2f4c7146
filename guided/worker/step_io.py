"""What crosses the engine/worker boundary, whichever executor runs the step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class StepMasks:
    """The filled bitmask rows, and per sampled row the row it reads (-1: unconstrained)."""
    bitmask: torch.Tensor  # (R, ceil(V / 32)) int32 on the host
    mask_rows: list[int]  # (N,)


@dataclass(slots=True)
class PromptLogprobs:
    """One prompt span's logprobs (scheduler/output.py PromptLogprobSpan): per target token its
    logprob and rank (1: the likeliest), and the span's top tokens, best first."""
    logprobs: list[float]  # (M,)
    ranks: list[int]  # (M,)
    top_ids: list[list[int]]  # (M, num_top)
    top_logprobs: list[list[float]]  # (M, num_top)


@dataclass(slots=True)
class RunnerOutput:
    token_ids: list[int]  # (N,) one sampled token per row
    logprobs: list  # (N,) (sampled lp, top-k) per row, or None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # per prompt span


class SampledTokens(Protocol):
    def result(self) -> RunnerOutput: ...
