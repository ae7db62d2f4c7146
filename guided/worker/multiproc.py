"""tensor_parallel_size > 1: one worker process per rank (worker/rank_process.py) and the
typed messages they exchange, each pickled once and written to every rank's pipe.

    engine -> every rank:  WorkerSpec, then per step Launch and Sample; Forget; Stop
    every rank -> engine:  Ready once; Failed(rank, error) when it cannot go on
    rank 0 -> engine:      Sampled(step, RunnerOutput) per step

Bitmask rows travel through shared memory (worker/shared_bitmasks.py); Sample names the slot.
The ranks join over env:// as torchrun sets it. A rank that dies or fails (seen at once through
a pidfd per process) makes this and every later call raise WorkerDied."""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from guided.config import EngineConfig
from guided.errors import EngineDeadError
from guided.scheduler.output import SchedulerOutput
from guided.worker import loader
from guided.worker.model_config import ModelConfig
from guided.worker.model_runner import resolve_device
from guided.worker.shared_bitmasks import SharedBitmasks
from guided.worker.step_io import RunnerOutput, StepMasks
from guided.worker.step_times import StepTimes

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # building a 70B shard and capturing its graphs takes minutes
STOP_GRACE_S = 10.0  # a rank told to stop leaves the group and exits; past this it is killed


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A rank's first message: it builds its shard from these."""
    config: EngineConfig
    model_config: ModelConfig
    vocab_size: int
    rank: int
    world_size: int
    masks_path: str  # the shared segment of the ranks' mask counters (shared_bitmasks.py)
    log_level: int


@dataclass(frozen=True, slots=True)
class MaskSlot:
    """A step's bitmask rows: rows [0, num_rows) of slot `slot`'s segment, the file `path`."""
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
    """A step failed on the engine's side: drop the steps in flight."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the process group and exit."""


@dataclass(frozen=True, slots=True)
class Ready:
    """A rank's shard and KV cache are built (num_blocks: agreed over all ranks)."""
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


def encode(message: WorkerSpec | Launch | Sample | Forget | Stop | Ready | Sampled | Failed
           ) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


class WorkerDied(EngineDeadError):
    """A rank is gone or failed: the executor cannot run another step."""


class RankHandle:
    """The engine's end of one rank: its process, its pipe, a pidfd that wakes wait() at exit."""

    def __init__(self, rank: int, env: dict[str, str]):
        ours, theirs = socket.socketpair()
        self.rank = rank
        self.process = subprocess.Popen(
            [sys.executable, "-m", "guided.worker.rank_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.pidfd = os.pidfd_open(self.process.pid) if hasattr(os, "pidfd_open") else None
        self.inbox: deque = deque()  # messages read while waiting on another rank


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, *, vocab_size: int,
                 step_times: StepTimes):
        n = config.tensor_parallel_size
        self.times = step_times
        device = resolve_device(config)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        if not (config.model.startswith("synthetic:") or config.model.endswith(".gguf")):
            loader.resolve_model_dir(config.model)  # converted once here, not by every rank
        self._error: WorkerDied | None = None
        self._step = 0  # the last launched step
        self._launched = False
        self._masks = SharedBitmasks(-(-vocab_size // 32), n)
        self._mask_slot: tuple[int, str, int] | None = None
        self._pending: dict[int, RunnerOutput] = {}  # rank 0's tokens read ahead, by step
        self.ranks: list[RankHandle] = []
        atexit.register(self.shutdown)  # an engine never shut down still reaps its ranks
        with socket.socket() as s:  # a free port, unless MASTER_PORT names one
            s.bind(("127.0.0.1", 0))
            port = os.environ.get("MASTER_PORT") or str(s.getsockname()[1])
        try:
            for rank in range(n):
                self.ranks.append(RankHandle(rank, rank_env(rank, n, device.type, port)))
            for handle in self.ranks:
                handle.conn.send_bytes(encode(WorkerSpec(
                    config, model_config, vocab_size, handle.rank, n, self._masks.consumed_path,
                    logging.getLogger().getEffectiveLevel())))
            ready = [self._receive(h, Ready, deadline=time.monotonic() + START_TIMEOUT_S)
                     for h in self.ranks]
        except BaseException:
            self.shutdown()
            raise
        self._masks.unlink_counters()  # every rank has them mapped
        first = ready[0]  # num_blocks: the least any rank has room for (ModelRunner)
        self.num_blocks, self.max_model_len = first.num_blocks, first.max_model_len
        self.max_draft_tokens = first.max_draft_tokens
        self.device, self.dtype = first.device, first.dtype

    def launch(self, out: SchedulerOutput) -> None:
        if self._launched:
            raise RuntimeError("a step is launched and not sampled yet")
        self._step += 1
        self._broadcast(Launch(self._step, out))
        self._launched = True

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        rows, slot, path = self._masks.take(num_rows, self._step, wait=self._check_alive)
        self._mask_slot = (slot, path, num_rows)
        return rows

    def sample(self, masks: StepMasks | None) -> PendingTokens:
        if not self._launched:
            raise RuntimeError("nothing launched to sample")
        self._launched = False
        slot = None
        if masks is not None and masks.bitmask.shape[0]:
            index, path, num_rows = self._mask_slot
            slot = MaskSlot(index, path, num_rows, masks.mask_rows)
        self._broadcast(Sample(self._step, slot))
        if slot is not None:
            self._masks.sent(slot.slot, self._step)
        return PendingTokens(self, self._step)

    def forget(self) -> None:
        self._launched = False
        self._pending.clear()
        if self._error is None:
            self._broadcast(Forget())

    def _broadcast(self, message) -> None:
        self._check_alive()
        with self.times.phase("send"):
            data = encode(message)  # pickled once for all ranks
            try:
                for handle in self.ranks:
                    handle.conn.send_bytes(data)
            except OSError as e:
                self._died(f"a rank's pipe broke ({e})")

    def tokens_of(self, step: int) -> RunnerOutput:
        """Step `step`'s tokens from rank 0 (older, forgotten steps' are dropped)."""
        while step not in self._pending:
            message = self._receive(self.ranks[0], Sampled, deadline=None)
            if message.step >= step:
                self._pending[message.step] = message.output
        return self._pending.pop(step)

    def _receive(self, handle: RankHandle, kind: type, *, deadline: float | None):
        """The next `kind` from handle's rank; any rank's Failed or exit raises WorkerDied."""
        self._check_alive()
        watched = {h.conn: h for h in self.ranks}
        watched.update({h.pidfd: h for h in self.ranks if h.pidfd is not None})
        while True:
            while handle.inbox:
                message = handle.inbox.popleft()
                if isinstance(message, kind):
                    return message
            timeout = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if timeout <= 0:
                self._died(f"rank {handle.rank} sent no {kind.__name__} in time")
            for ready in wait(list(watched), timeout=timeout):
                source = watched[ready]
                if ready is not source.conn:  # its pidfd: the process ended
                    self._died(self._last_words(source))
                message = self._read(source)
                if isinstance(message, Failed):
                    self._died(f"rank {message.rank} failed: {message.error}")
                source.inbox.append(message)
            self._check_alive()  # no pidfd (old kernels): poll the processes

    def _last_words(self, handle: RankHandle) -> str:
        """Why a rank ended: the failure it reported, else how it exited."""
        try:
            handle.process.wait(timeout=STOP_GRACE_S)  # its pipe closes as it exits
        except subprocess.TimeoutExpired:
            return f"rank {handle.rank} closed its pipe"
        with contextlib.suppress(EOFError, OSError):
            while handle.conn.poll():
                message = decode(handle.conn.recv_bytes())
                if isinstance(message, Failed):
                    return f"rank {message.rank} failed: {message.error}"
        code = handle.process.returncode
        return f"rank {handle.rank} exited " + (f"with code {code}" if code >= 0
                                               else f"by signal {-code}")

    def _read(self, handle: RankHandle):
        try:
            return decode(handle.conn.recv_bytes())
        except (EOFError, OSError):
            self._died(self._last_words(handle))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error
        for handle in self.ranks:
            if handle.process.poll() is not None:
                self._died(self._last_words(handle))

    def _died(self, why: str):
        if self._error is None:
            self._error = WorkerDied(f"tensor-parallel worker lost: {why}; the engine cannot "
                                     "run further steps (restart it)")
            log.error("%s", self._error)
            for handle in self.ranks:
                if handle.process.poll() is None:
                    handle.process.kill()
            for handle in self.ranks:
                handle.process.wait()
        raise self._error

    def shutdown(self) -> None:
        """Stop, then SIGKILL whoever is left after STOP_GRACE_S; reap; free shared memory."""
        if self._error is None and self.ranks:
            with contextlib.suppress(WorkerDied):
                self._broadcast(Stop())
        deadline = time.monotonic() + STOP_GRACE_S
        for handle in self.ranks:
            try:
                handle.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                handle.process.kill()
                handle.process.wait()
        for handle in self.ranks:
            handle.conn.close()
            if handle.pidfd is not None:
                os.close(handle.pidfd)
                handle.pidfd = None
        self.ranks = []
        self._masks.close()
        atexit.unregister(self.shutdown)


class PendingTokens:
    """A sampled step's tokens, on their way from rank 0."""

    def __init__(self, executor: MultiprocExecutor, step: int):
        self._executor = executor
        self.step = step
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._result is None:
            self._result = self._executor.tokens_of(self.step)
        return self._result


def rank_env(rank: int, world_size: int, device_type: str, master_port: str
             ) -> dict[str, str]:
    """The env:// rendezvous as torchrun sets it, and this tree on the rank's path."""
    env = dict(os.environ)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.update(MASTER_PORT=master_port, RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_RANK=str(rank))
    if device_type == "cpu":  # torch's threads: the host's cores shared out between the ranks
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // world_size))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env

