"""What a step carries through the worker: its tensors, the forward pass in flight, the tokens on
their way to the host; and the two values the worker is handed, the SchedulerOutput
(scheduler/output.py) and the step's masks (StepMasks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.sampler import DeviceSample, SamplingRows


@dataclass(slots=True)
class StepMasks:
    """A step's grammar masks as a value: the filled bitmask rows (token bans applied), and per
    sampled row the row it reads (-1: unconstrained). To the worker a mask is a tensor."""
    bitmask: torch.Tensor  # (R, ceil(V / 32)) int32 on the host
    mask_rows: list[int]  # (N,)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the packed batch that are sampled
    rows: SamplingRows
    query_lens: list[int]  # (B,) new tokens per request
    has_drafts: bool
    # overlapped scheduling: input_ids[placeholder_index[i]] is the token the previous step
    # samples in its row placeholder_row[i] (not yet known on the host)
    placeholder_index: list[int] = field(default_factory=list)
    placeholder_row: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass is on the device; its sampling waits for the grammar masks."""
    inputs: StepInputs
    logits: torch.Tensor | None  # (N, V) on the device; None: nothing sampled this step


@dataclass(slots=True)
class RunnerOutput:
    token_ids: list[int]  # (N,) one sampled token per row
    logprobs: list  # (N,) (sampled lp, top-k) per row, or None


class SampledTokens(Protocol):
    """A step's tokens on their way to the host, whichever executor sampled them."""

    def result(self) -> RunnerOutput: ...


@dataclass(slots=True)
class SampledStep:
    """A step whose tokens are sampled on the device and on their way to the host."""
    inputs: StepInputs
    samples: DeviceSample | None

    @property
    def token_ids(self) -> torch.Tensor | None:
        """The sampled ids on the device, one per sampled row."""
        return None if self.samples is None else self.samples.token_ids

    def result(self) -> RunnerOutput:
        if self.samples is None:
            return RunnerOutput([], [])
        out = self.samples.result()
        return RunnerOutput(out.token_ids, out.logprobs)
