"""Worker processes that build token DFAs' transition tables (fsm/dfa_tables.py) from their
regexes, so that neither serializing an index (~2 ms a MB) nor reading every transition (a
Python dict of each, ~0.1 s a million) holds the engine's GIL: the compile thread that asks
waits on a pipe, without the GIL. A worker builds the index again from the regex (the CPU
work of a second compile, off the engine's process).

A worker is `python -m guided.fsm.table_worker`, sent the vocabulary once and then regexes as
length-prefixed pickles on stdin, answering on stdout; a plain subprocess, not
multiprocessing's spawn, which would re-import the caller's __main__ (a user's script).
Workers start on first use; one that fails is replaced.
"""
from __future__ import annotations

import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from guided.fsm.dfa_tables import DfaTables, index_tables

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


class TableWorkers:
    def __init__(self, num_workers: int, *, eos: int, token_map: dict[bytes, list[int]],
                 num_words: int):
        """eos, token_map: the outlines-core Vocabulary's arguments (fsm/backends/dfa_backend.py
        DfaVocab); num_words: a mask row's int32 words."""
        self._vocab = (eos, token_map, num_words)
        # the threads that wait on the workers: not the compile pool's, whose compiles must
        # never queue behind tables
        self._threads = ThreadPoolExecutor(max(1, num_workers),
                                           thread_name_prefix="guided-dfa-tables")
        self._idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(max(1, num_workers)):
            self._idle.put(None)  # started when first taken
        self._lock = threading.Lock()
        self._all: list[subprocess.Popen] = []
        self._closed = False

    def build_later(self, dfa, max_bytes: int) -> Future:
        """dfa.build_tables(max_bytes, self) on a thread of these workers'."""
        return self._threads.submit(dfa.build_tables, max_bytes, self)

    def tables(self, regex: str, max_bytes: int) -> DfaTables | None:
        """The tables of the index of `regex` (None: larger than max_bytes serialized), from an
        idle worker (waits for one)."""
        worker = self._idle.get()
        try:
            if worker is None or worker.poll() is not None:
                worker = self._start()
            send_message(worker.stdin, (regex, max_bytes))
            ok, result = receive_message(worker.stdout)
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
        self._threads.shutdown(wait=False, cancel_futures=True)
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
        send_message(worker.stdin, self._vocab)
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
    import os

    import outlines_core as oc

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    os.nice(10)  # never ahead of the engine's step loop for a core
    try:
        eos, token_map, num_words = receive_message(stdin)
    except EOFError:
        return
    vocabulary = oc.Vocabulary(eos, token_map)
    while True:
        try:
            regex, max_bytes = receive_message(stdin)
        except EOFError:
            return
        try:
            index = oc.Index(regex, vocabulary)
            answer = (True, index_tables(index, num_words, eos, max_bytes))
        except Exception as e:  # noqa: BLE001 - reported to the asker, the worker lives on
            answer = (False, repr(e))
        send_message(stdout, answer)


if __name__ == "__main__":
    main()
