"""What a step carries between the runner's stages: its inputs, the forward pass in flight,
the tokens on their way to the host, and what the host reads of them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.sampler import DeviceSample, SamplingRows


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the packed batch that are sampled
    rows: SamplingRows
    row_owner: list[int]  # (N,) index into sched.scheduled per sampled row
    mask_rows: list[int]  # (N,) bitmask row per sampled row, -1: unconstrained
    num_mask_rows: int
    query_lens: list[int]  # (B,) new tokens per request
    has_drafts: bool
    # overlapped scheduling: input_ids[placeholder_index[i]] is the token the previous step
    # samples in its row placeholder_row[i] (not yet known on the host)
    placeholder_index: list[int] = dataclasses.field(default_factory=list)
    placeholder_row: list[int] = dataclasses.field(default_factory=list)
    row_of_request: dict[str, int] = dataclasses.field(default_factory=dict)  # first sampled row


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward pass is on the device; its sampling waits for the grammar masks."""
    inputs: StepInputs
    logits: torch.Tensor | None  # (N, V) on the device; None: nothing sampled this step
    # recorded after the logits (CUDA): the device is done with the forward pass once it is
    # reached; None where the forward pass ran within the launch (CPU)
    forward_done: torch.cuda.Event | None = None

    def device_waits(self) -> bool:
        """Whether the device has finished the forward pass, so that its sampling (and all
        after it) now waits on the host; True on the CPU."""
        return self.forward_done is None or self.forward_done.query()


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
        num_scheduled = len(self.inputs.query_lens)
        sampled: list[list[int]] = [[] for _ in range(num_scheduled)]
        logprobs: list[list] = [[] for _ in range(num_scheduled)]
        candidates: dict[int, dict[int, list[int]]] = {}
        if self.samples is not None:
            out = self.samples.result()
            owners = self.inputs.row_owner
            for row, owner in enumerate(owners):
                sampled[owner].append(out.token_ids[row])
                logprobs[owner].append(out.logprobs[row])
            if out.candidates:
                first: dict[int, int] = {}
                for row, owner in enumerate(owners):
                    first.setdefault(owner, row)
                for row, best in out.candidates.items():
                    owner = owners[row]
                    candidates.setdefault(owner, {})[row - first[owner]] = best
        return RunnerOutput(sampled, logprobs, candidates)


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[list[int]]  # per scheduled request: its sampled tokens (empty: no sampling)
    logprobs: list[list]  # per scheduled request: per sampled token (lp, top) or None
    # per scheduled request sampled unmasked: its j-th sampled token's candidates, best first
    candidates: dict[int, dict[int, list[int]]] = dataclasses.field(default_factory=dict)
    # scheduled requests whose matchers took their sampled tokens already (multi-step decode)
    accepted: frozenset[int] = frozenset()
