"""One tensor-parallel rank: `python -m guided.worker.rank_process FD`, started by
worker/multiproc.py with the env:// rendezvous in its environment and its pipe as FD.

Every rank samples the same tokens (same gathered logits, masks and seeded noise), so each keeps
its last sampled ids on its device for the next step's placeholders; rank 0 alone sends them
back. Any failure is reported (Failed) and ends the process: a rank that stopped halfway through
a collective leaves the group unusable."""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch

from guided.worker import loader
from guided.worker import multiproc as mp
from guided.worker.model_runner import LocalExecutor, ModelRunner, resolve_device
from guided.worker.models.parallel import destroy_distributed, init_distributed, rank_device
from guided.worker.shared_bitmasks import MaskReader
from guided.worker.step_io import StepMasks

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when the engine's goes: a rank blocked in a collective would never
    read the closed pipe, and would hold its GPU forever."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RankWorker:
    def __init__(self, spec: mp.WorkerSpec, conn: Connection):
        self.spec = spec
        self.conn = conn
        self._send_lock = threading.Lock()
        device = resolve_device(spec.config)
        self.ctx = init_distributed(rank_device(device.type))
        self.runner = ModelRunner(spec.config, spec.model_config,
                                  loader.weight_reader(spec.config.model, spec.config.seed),
                                  vocab_size=spec.vocab_size, ctx=self.ctx)
        if self.runner.device.type == "cuda":
            # a step's CPU work is small copies: the ranks' torch thread pools only fight each other
            torch.set_num_threads(1)
        self.masks = MaskReader(spec.rank, spec.masks_path, self.runner.mask_words,
                                spec.world_size)
        # rank 0 on a GPU sends from a thread: waiting for step t's tokens never holds up t+1
        self._outbox: queue.Queue | None = None
        if spec.rank == 0 and self.runner.device.type == "cuda":
            self._outbox = queue.Queue()
            threading.Thread(target=self._send_results, name="rank0-results",
                             daemon=True).start()

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send_bytes(mp.encode(message))

    def ready(self) -> mp.Ready:
        local = LocalExecutor(self.runner)
        return mp.Ready(self.spec.rank, local.num_blocks, local.max_model_len,
                        local.max_draft_tokens, local.device, local.dtype)

    def serve(self) -> None:
        while True:
            message = mp.decode(self.conn.recv_bytes())
            if isinstance(message, mp.Launch):
                self.runner.launch(message.out)
            elif isinstance(message, mp.Sample):
                self._sample(message)
            elif isinstance(message, mp.Forget):
                self.runner.forget()
            elif isinstance(message, mp.Stop):
                return
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")

    def _sample(self, message: mp.Sample) -> None:
        masks = None
        slot = message.masks
        if slot is not None:
            rows = self.masks.read(slot.slot, slot.path, slot.num_rows)
            own = self.runner.new_bitmask(slot.num_rows)
            own.copy_(rows)  # out of the shared slot at once: the engine refills it
            self.masks.consumed(message.step)
            masks = StepMasks(own, slot.mask_rows)
        sampled = self.runner.sample(masks)
        if self.spec.rank != 0:
            return
        if self._outbox is None:
            self.send(mp.Sampled(message.step, sampled.result()))
        else:
            self._outbox.put((message.step, sampled))

    def _send_results(self) -> None:
        while True:
            step, sampled = self._outbox.get()
            try:
                self.send(mp.Sampled(step, sampled.result()))
            except BaseException as e:  # noqa: BLE001 - reported, then the process ends
                self.fail(e)

    def fail(self, error: BaseException) -> None:
        log.exception("rank %d failed", self.spec.rank)
        with contextlib.suppress(OSError):
            self.send(mp.Failed(self.spec.rank, f"{type(error).__name__}: {error}"))
        os._exit(1)  # threads and the process group left as they are: the engine reaps us

    def close(self) -> None:
        self.masks.close()
        destroy_distributed(self.ctx)


def main(fd: int) -> None:
    die_with_parent()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # kill -USR2: where a rank hangs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops the ranks (Stop, or kill)
    conn = Connection(fd)
    spec: mp.WorkerSpec = mp.decode(conn.recv_bytes())
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s")
    worker = None
    try:
        worker = RankWorker(spec, conn)
        worker.send(worker.ready())
        worker.serve()
    except (EOFError, ConnectionResetError):  # the engine went away
        os._exit(0)
    except BaseException as e:
        if worker is None:
            log.exception("rank %d failed to start", spec.rank)
            conn.send_bytes(mp.encode(mp.Failed(spec.rank, f"{type(e).__name__}: {e}")))
            os._exit(1)
        worker.fail(e)
    worker.close()
    conn.close()
    logging.shutdown()
    os._exit(0)  # left the group: the interpreter's teardown has nothing left to do


if __name__ == "__main__":
    main(int(sys.argv[1]))
