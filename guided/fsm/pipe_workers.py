"""A pool of worker processes asked one question at a time over pipes (the DFA table workers,
fsm/table_worker.py; the schema workers, fsm/schema_worker.py): the asking thread waits on a
pipe, without the GIL, while the work runs in another process.

A worker is `python -m <module>`, sent length-prefixed pickles on stdin and answering on
stdout: a plain subprocess, not multiprocessing's spawn, which would re-import the caller's
__main__ (a user's script). Workers start on first use; one that fails is replaced.
"""
from __future__ import annotations

import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def send_message(stream: BinaryIO, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def receive_message(stream: BinaryIO):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the worker closed its pipe")
    return pickle.loads(data)


class PipeWorkers:
    """num_workers processes of `module`, each sent `greeting` (if any) when it starts."""

    def __init__(self, module: str, num_workers: int, *, greeting: Any = None):
        self._module, self._greeting = module, greeting
        self._idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(max(1, num_workers)):
            self._idle.put(None)  # started when first taken
        self._lock = threading.Lock()
        self._all: list[subprocess.Popen] = []
        self._closed = False

    def ask(self, question) -> Any:
        """An idle worker's answer (waits for one). Raises OSError, EOFError or RuntimeError
        where the worker failed (it is replaced for the next question)."""
        worker = self._idle.get()
        try:
            if worker is None or worker.poll() is not None:
                worker = self._start()
            send_message(worker.stdin, question)
            return receive_message(worker.stdout)
        except (OSError, EOFError, RuntimeError):
            self._stop(worker)
            worker = None
            raise
        finally:
            self._idle.put(worker)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            self._stop(worker)

    def _start(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._module} workers are shut down")
            worker = subprocess.Popen([sys.executable, "-m", self._module],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._all.append(worker)
        if self._greeting is not None:
            send_message(worker.stdin, self._greeting)
        return worker

    @staticmethod
    def _stop(worker: subprocess.Popen | None) -> None:
        if worker is None:
            return
        try:
            worker.stdin.close()
            worker.wait(timeout=2)
        except Exception:  # noqa: BLE001 - already gone, or stuck: killed
            worker.kill()
