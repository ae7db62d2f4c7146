"""Worker processes that build token DFAs' transition tables (fsm/dfa_tables.py) from their
serialized indexes, so that reading every transition (a Python dict of each, ~0.1 s a million
under the GIL) never stalls the engine's step loop: the compile thread that asks waits on a
pipe, without the GIL.

A worker is `python -m guided.fsm.table_worker`, fed length-prefixed pickles on stdin and
answering on stdout; a plain subprocess, not multiprocessing's spawn, which would re-import the
caller's __main__ (a user's script). Workers start on first use; one that fails is replaced.
"""
from __future__ import annotations

import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

from guided.fsm.dfa_tables import StateTables, index_tables

_HEADER = struct.Struct("<Q")


def _send(stream: BinaryIO, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: BinaryIO):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the table worker closed its pipe")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the table worker closed its pipe")
    return pickle.loads(data)


class TableWorkers:
    def __init__(self, num_workers: int):
        self._idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(max(1, num_workers)):
            self._idle.put(None)  # started when first taken
        self._lock = threading.Lock()
        self._all: list[subprocess.Popen] = []
        self._closed = False

    def tables(self, index_bytes: bytes, num_words: int, eos: int) -> StateTables:
        """The tables of a serialized index, from an idle worker (waits for one)."""
        worker = self._idle.get()
        try:
            if worker is None or worker.poll() is not None:
                worker = self._start()
            _send(worker.stdin, (index_bytes, num_words, eos))
            ok, result = _receive(worker.stdout)
        except (OSError, EOFError) as e:
            self._stop(worker)
            worker = None
            raise RuntimeError(f"the DFA table worker failed: {e}") from e
        finally:
            self._idle.put(worker)
        if not ok:
            raise RuntimeError(f"the DFA table worker failed: {result}")
        return result

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            self._stop(worker)

    def _start(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError("the DFA table workers are shut down")
            worker = subprocess.Popen([sys.executable, "-m", "guided.fsm.table_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._all.append(worker)
            return worker

    def _stop(self, worker: subprocess.Popen | None) -> None:
        if worker is None:
            return
        try:
            worker.stdin.close()
            worker.wait(timeout=2)
        except Exception:  # noqa: BLE001 - already gone, or stuck: killed
            worker.kill()


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    while True:
        try:
            index_bytes, num_words, eos = _receive(stdin)
        except EOFError:
            return
        try:
            answer = (True, index_tables(index_bytes, num_words, eos))
        except Exception as e:  # noqa: BLE001 - reported to the asker, the worker lives on
            answer = (False, repr(e))
        _send(stdout, answer)


if __name__ == "__main__":
    main()
