"""What the engine and its worker processes (tensor-parallel ranks) say to each other: typed
dataclasses, pickled once per step and written to every rank's pipe (worker/multiproc.py).

    engine -> every rank:   WorkerSpec once, then Launch(step, SchedulerOutput),
                            Sample(step, masks), Forget, Stop
    rank 0 -> engine:       Ready(...) once, then Sampled(step, RunnerOutput) per step
    any rank -> engine:     Ready once; Failed(rank, error) when it cannot go on

A step's bitmask rows do not travel in Sample: the engine fills them straight into a slot of
shared memory (worker/shared_bitmasks.py) and Sample names the slot (MaskSlot)."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from guided.config import EngineConfig
from guided.scheduler.output import SchedulerOutput
from guided.worker.model_config import ModelConfig
from guided.worker.step_io import RunnerOutput


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a rank is started with (its first message): it builds its shard from these."""
    config: EngineConfig
    model_config: ModelConfig
    vocab_size: int
    rank: int
    world_size: int
    masks_path: str  # the shared segment of the ranks' mask counters (shared_bitmasks.py)
    log_level: int


@dataclass(frozen=True, slots=True)
class MaskSlot:
    """Where a step's bitmask rows lie: rows [0, num_rows) of slot `slot`'s shared segment,
    the file `path` (a slot's segment is replaced when it grows)."""
    slot: int
    path: str
    num_rows: int
    mask_rows: list[int]  # (N,) each sampled row's bitmask row, -1: unconstrained


@dataclass(frozen=True, slots=True)
class Launch:
    step: int
    out: SchedulerOutput


@dataclass(frozen=True, slots=True)
class Sample:
    step: int  # the launched step this samples
    masks: MaskSlot | None


@dataclass(frozen=True, slots=True)
class Forget:
    """A step failed on the engine's side: drop the steps in flight (launched, last sampled)."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the process group and exit."""


@dataclass(frozen=True, slots=True)
class Ready:
    """A rank has built its shard and its KV cache (num_blocks: agreed over all ranks)."""
    rank: int
    num_blocks: int
    max_model_len: int
    max_draft_tokens: int | None
    device: str
    dtype: str


@dataclass(frozen=True, slots=True)
class Sampled:
    step: int
    output: RunnerOutput


@dataclass(frozen=True, slots=True)
class Failed:
    rank: int
    error: str  # "ExceptionType: message"


ToWorker = WorkerSpec | Launch | Sample | Forget | Stop
FromWorker = Ready | Sampled | Failed


def encode(message: ToWorker | FromWorker) -> bytes:
    """Pickled once, written to each rank's pipe as bytes."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> ToWorker | FromWorker:
    return pickle.loads(data)
