"""A bounded thread pool whose jobs have a deadline (the grammar compiles' and the background DFA
builds'), and the lowered priority its threads run at. A C++ compile cannot be interrupted, so a
job past its deadline is abandoned: its future fails at once and a fresh worker replaces it."""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from guided.errors import ConstraintError


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Add `nice` to the calling thread's niceness, and with `idle` put it under SCHED_IDLE
    (Linux: a thread's priority is its own, and threads it starts inherit it). Best effort:
    elsewhere, or without permission, a no-op."""
    tid = threading.get_native_id()
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            pass
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


class WatchdogPool:
    """A bounded thread pool whose jobs have a deadline from the moment they start.

    Invariants: live workers <= num_workers; live + abandoned (timed out, still running)
    <= 2 x num_workers, so stuck compiles shrink the pool rather than grow the thread count;
    an abandoned worker rejoins the pool when its compile ends if the pool is short, else exits.
    """

    def __init__(self, *, num_workers: int, timeout_s: float, nice: int = 0,
                 idle: bool = False, name: str = "grammar-compile"):
        self.num_workers = max(1, num_workers)
        self.name = name  # its threads' (the server's stats log names the busiest)
        self.timeout_s = timeout_s
        self.nice = nice
        self.idle = idle  # SCHED_IDLE (lower_thread_priority)
        self._cond = threading.Condition()
        self._jobs: list[tuple[Future, Callable[[], Any], str]] = []
        self._deadlines: list[tuple[float, int, int]] = []  # heap: (deadline, job id, worker id)
        self._running: dict[int, tuple[Future, str, int]] = {}  # worker id -> its current job
        self._abandoned: set[int] = set()
        self._live = 0
        self._ids = itertools.count()
        self._closed = False
        for _ in range(self.num_workers):
            self._spawn()
        threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True).start()

    @property
    def num_abandoned(self) -> int:
        with self._cond:
            return len(self._abandoned)

    @property
    def num_queued(self) -> int:
        """Jobs waiting for a worker."""
        with self._cond:
            return len(self._jobs)

    @property
    def num_threads(self) -> int:
        """Worker threads alive: never more than 2 x num_workers."""
        with self._cond:
            return self._live + len(self._abandoned)

    def submit(self, future: Future, fn: Callable[[], Any], *, label: str = "job") -> None:
        with self._cond:
            if self._closed:
                future.set_exception(ConstraintError("the grammar compiler is shut down"))
                return
            self._jobs.append((future, fn, label))
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for future, _, _ in self._jobs:
                if not future.done():
                    future.set_exception(ConstraintError("the grammar compiler is shut down"))
            self._jobs.clear()
            self._cond.notify_all()

    def _spawn(self) -> None:  # caller holds the lock (or is __init__)
        self._live += 1
        worker_id = next(self._ids)
        threading.Thread(target=self._work, args=(worker_id,), name=f"{self.name}-{worker_id}",
                         daemon=True).start()

    def _work(self, worker_id: int) -> None:
        lower_thread_priority(self.nice, self.idle)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._live -= 1
                    return
                future, fn, label = self._jobs.pop(0)
                if not future.set_running_or_notify_cancel():
                    continue
                job_id = next(self._ids)
                self._running[worker_id] = (future, label, job_id)
                heapq.heappush(self._deadlines,
                               (time.monotonic() + self.timeout_s, job_id, worker_id))
                self._cond.notify_all()  # wake the watchdog for the new deadline
            try:
                result, error = fn(), None
            except ConstraintError as e:
                result, error = None, e
            except Exception as e:  # a backend bug must fail the request, never the engine
                result, error = None, ConstraintError(f"{label} failed to compile: {e!r}")
            with self._cond:
                self._running.pop(worker_id, None)
                if not future.done():
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
                if worker_id in self._abandoned:
                    self._abandoned.discard(worker_id)
                    if self._live >= self.num_workers or self._closed:
                        return
                    self._live += 1  # the pool is short: rejoin it

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, job_id, worker_id = heapq.heappop(self._deadlines)
                    self._expire(worker_id, job_id)
                while self._deadlines and not self._is_running(*self._deadlines[0][1:]):
                    heapq.heappop(self._deadlines)  # finished in time
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._cond.wait(timeout=wait)

    def _is_running(self, job_id: int, worker_id: int) -> bool:
        running = self._running.get(worker_id)
        return running is not None and running[2] == job_id

    def _expire(self, worker_id: int, job_id: int) -> None:  # caller holds the lock
        if not self._is_running(job_id, worker_id) or worker_id in self._abandoned:
            return
        future, label, _ = self._running[worker_id]
        if not future.done():
            future.set_exception(ConstraintError(
                f"{label} compile timed out after {self.timeout_s:g} s (compile_timeout_s)"))
        self._abandoned.add(worker_id)
        self._live -= 1
        if self._live + len(self._abandoned) < 2 * self.num_workers:
            self._spawn()
