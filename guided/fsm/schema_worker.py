"""Worker processes that check JSON schemas: the one stage of a compile that holds the GIL
(~7 ms a schema, which the step loop needs every few microseconds); the asking compile thread
waits on a pipe instead. A worker is `python -m guided.fsm.schema_worker` (not multiprocessing's
spawn, which re-imports the caller's __main__) fed pickles on stdin; one that fails is
replaced, its schema checked in the asking thread.
"""
from __future__ import annotations

import json
import logging
import pickle
import queue
import subprocess
import sys
import threading
from typing import BinaryIO

from guided.errors import ConstraintError

log = logging.getLogger(__name__)


def check(value: str) -> dict:
    """The schema (JSON text) as check_schema rewrites it."""
    from guided.fsm.schema_check import check_schema

    return check_schema(json.loads(value))


def _send(stream: BinaryIO, obj) -> None:
    pickle.dump(obj, stream, protocol=5)
    stream.flush()


class SchemaWorkers:
    def __init__(self, num_workers: int):
        self._idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(max(1, num_workers)):
            self._idle.put(None)  # started when first taken
        self._lock = threading.Lock()
        self._all: list[subprocess.Popen] = []
        self._closed = False

    def check(self, value: str) -> dict:
        """check() on an idle worker; in this thread if the worker fails."""
        worker = self._idle.get()
        try:
            if worker is None or worker.poll() is not None:
                worker = self._start()
            _send(worker.stdin, value)
            kind, result = pickle.load(worker.stdout)
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
            self._stop(worker)
            worker = None
            log.warning("a schema worker failed (%s): checking the schema in-process", e)
            return check(value)
        finally:
            self._idle.put(worker)
        if kind == "ok":
            return result
        if kind == "refused":
            raise ConstraintError(result)
        raise RuntimeError(f"checking the schema failed: {result}")

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            self._stop(worker)

    def _start(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise RuntimeError("the schema workers are shut down")
            worker = subprocess.Popen([sys.executable, "-m", "guided.fsm.schema_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._all.append(worker)
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


def main() -> None:
    import os

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    os.nice(10)  # a compile's stage: beside the compile threads, below the step loop
    while True:
        try:
            value = pickle.load(stdin)
        except EOFError:
            return
        try:
            answer = ("ok", check(value))
        except ConstraintError as e:
            answer = ("refused", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the asker, the worker lives on
            answer = ("failed", repr(e))
        _send(stdout, answer)


if __name__ == "__main__":
    main()
