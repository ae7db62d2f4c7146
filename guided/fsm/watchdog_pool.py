"""A bounded thread pool whose jobs (grammar compiles) have a deadline, at a lowered priority.

A C++ compile cannot be interrupted, so a job past its deadline or dropped by its owner while
running is abandoned: it runs on at nice 19 and a fresh worker replaces it. With max_wait_s,
queued sheddable jobs that would not start within it are cancelled rather than left to time out
(an offline batch's are submitted not sheddable)."""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from guided.errors import ConstraintError

log = logging.getLogger(__name__)
# threads (live and abandoned) per worker: stuck compiles shrink the pool, never grow it
MAX_THREADS_PER_WORKER = 4
# each finished job moves the typical duration this far towards its own
_DURATION_WEIGHT = 0.2
# with max_wait_s: how often queued jobs are checked for whether they can still start in time
_SHED_EVERY_S = 0.2


def _renice(tid: int | None, nice: int, idle: bool = False) -> None:
    """Add `nice` to a thread's niceness (19 at most), and with `idle` put it under SCHED_IDLE
    (Linux: threads it starts inherit both). Best effort: elsewhere, or unpermitted, a no-op."""
    if tid is None:
        return
    if nice > 0:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    if idle:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Settle future unless it is settled already (a timeout, a cancel)."""
    with contextlib.suppress(InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class WatchdogPool:
    """Invariants: live workers <= num_workers; live + abandoned <= MAX_THREADS_PER_WORKER x
    num_workers; an abandoned worker exits when its job ends, replaced if the pool is short."""

    def __init__(self, *, num_workers: int, timeout_s: float, nice: int = 0,
                 idle: bool = False, max_wait_s: float | None = None):
        self.num_workers = max(1, num_workers)
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s  # None: queued jobs wait however long it takes
        self.nice = nice
        self.idle = idle
        self._cond = threading.Condition()
        # queued: (future, fn, label, on_overdue, sheddable)
        self._jobs: list[tuple[Future, Callable[[], Any], str, Callable[[], None] | None,
                               bool]] = []
        # worker id -> its current job: (future, label, on_overdue, start time)
        self._running: dict[int, tuple[Future, str, Callable[[], None] | None, float]] = {}
        self._tids: dict[int, int] = {}  # worker id -> its thread's native id
        self._abandoned: set[int] = set()
        self._mean_s: float | None = None  # how long a job holds a worker, moving average
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
        with self._cond:
            return len(self._jobs)

    @property
    def num_threads(self) -> int:
        with self._cond:
            return self._live + len(self._abandoned)

    def room(self) -> float:
        """How many more jobs could queue now and still start within max_wait_s."""
        with self._cond:
            return self._start_limit(time.monotonic()) - len(self._jobs)

    def _start_limit(self, now: float) -> float:  # caller holds the lock
        """How many queued jobs can start within max_wait_s: one per idle live worker now, then
        one per live worker each typical job duration (the recent mean, or the running jobs'
        median so far where longer: a storm's first compiles show it before any ends)."""
        if self.max_wait_s is None:
            return math.inf
        elapsed = [now - started for started in self._starts()]
        typical = min(self.timeout_s, max(self._mean_s or 0.0,
                                          statistics.median(elapsed) if elapsed else 0.0))
        if typical <= 0:  # nothing measured yet
            return math.inf if self._live else 0
        rounds = math.ceil(self.max_wait_s / typical) - 1  # starts at k x typical < max_wait_s
        return max(0, self._live - len(elapsed)) + self._live * rounds

    def submit(self, future: Future, fn: Callable[[], Any], *, label: str = "job",
               on_overdue: Callable[[], None] | None = None, sheddable: bool = True) -> None:
        """Run fn() for future. Past timeout_s of running: on_overdue() if given (the job may
        still settle the future), else the future fails."""
        with self._cond:
            if self._closed:
                future.set_exception(ConstraintError("the grammar compiler is shut down"))
                return
            self._jobs.append((future, fn, label, on_overdue, sheddable))
            self._cond.notify_all()

    def drop(self, future: Future) -> None:
        """Nobody waits for future's job: a queued one is cancelled, a running one abandoned."""
        with self._cond:
            queued = next((i for i, job in enumerate(self._jobs) if job[0] is future), None)
            if queued is not None:
                del self._jobs[queued]
            for worker_id, running in self._running.items():
                if running[0] is future and worker_id not in self._abandoned:
                    self._abandon(worker_id)
                    break
        if queued is not None:
            future.cancel()  # outside the lock: its callbacks may take their owner's lock

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = self._jobs, []
            self._cond.notify_all()
        for future, *_ in jobs:
            settle(future, error=ConstraintError("the grammar compiler is shut down"))

    def _spawn(self) -> None:  # caller holds the lock (or is __init__)
        self._live += 1
        worker_id = next(self._ids)
        # the server's stats log names the busiest threads
        threading.Thread(target=self._work, args=(worker_id,), name=f"grammar-compile-{worker_id}",
                         daemon=True).start()

    def _work(self, worker_id: int) -> None:
        _renice(threading.get_native_id(), self.nice, self.idle)
        with self._cond:
            self._tids[worker_id] = threading.get_native_id()
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._live -= 1
                    self._tids.pop(worker_id, None)
                    return
                future, fn, label, on_overdue, _ = self._jobs.pop(0)
                if not future.set_running_or_notify_cancel():
                    continue
                started = time.monotonic()
                self._running[worker_id] = (future, label, on_overdue, started)
                self._cond.notify_all()  # wake the watchdog for the new deadline
            try:
                result, error = fn(), None
            except ConstraintError as e:
                result, error = None, e
            except Exception as e:  # noqa: BLE001 - a backend bug fails the request, not the engine
                result, error = None, ConstraintError(f"{label} failed to compile: {e!r}")
            # outside the lock: the future's callbacks may take their owner's lock, which may
            # be held by a thread waiting for this one (submit)
            settle(future, result, error)
            with self._cond:
                self._running.pop(worker_id, None)
                if worker_id not in self._abandoned:  # (an abandoned one counted timeout_s)
                    self._observe(time.monotonic() - started)
                    continue
                # it may run at nice 19, which it cannot undo: a fresh worker takes its place
                self._abandoned.discard(worker_id)
                self._tids.pop(worker_id, None)
                if self._live < self.num_workers and not self._closed:
                    self._spawn()
                return

    def _observe(self, duration: float) -> None:  # caller holds the lock
        self._mean_s = duration if self._mean_s is None else (
            self._mean_s + _DURATION_WEIGHT * (duration - self._mean_s))

    def _watch(self) -> None:
        while True:
            overdue, shed = [], []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for worker_id, job in list(self._running.items()):
                    if worker_id not in self._abandoned and now - job[3] >= self.timeout_s:
                        overdue.append(self._expire(worker_id))
                excess = len(self._jobs) - self._start_limit(now)
                for i in range(len(self._jobs) - 1, -1, -1):  # the newest go: the first come
                    if excess <= 0:  # keep their turn
                        break
                    if self._jobs[i][4]:
                        shed.append(self._jobs.pop(i)[0])
                        excess -= 1
                if not overdue:
                    starts = self._starts()
                    wait = min(starts) + self.timeout_s - now if starts else None
                    if self._jobs and self.max_wait_s is not None:
                        wait = min(wait or _SHED_EVERY_S, _SHED_EVERY_S)
                    self._cond.wait(timeout=wait)
            for future in shed:  # outside the lock: its callbacks may take their owner's lock
                future.cancel()
            for on_overdue in overdue:  # outside the lock: it may drop jobs
                try:
                    on_overdue()
                except Exception:
                    log.exception("a job's overdue callback failed")

    def _starts(self) -> list[float]:  # caller holds the lock
        """When the live workers' running jobs started."""
        return [job[3] for w, job in self._running.items() if w not in self._abandoned]

    def _expire(self, worker_id: int) -> Callable[[], None]:
        """(lock held) What to call outside the lock for an overdue job: its overdue callback,
        else its future's failure."""
        future, label, on_overdue, _ = self._running[worker_id]
        self._observe(self.timeout_s)  # it held its worker that long
        self._abandon(worker_id)
        if on_overdue is not None:
            return on_overdue
        error = ConstraintError(
            f"{label} compile timed out after {self.timeout_s:g} s (compile_timeout_s)")
        return lambda: settle(future, error=error)

    def _abandon(self, worker_id: int) -> None:  # caller holds the lock
        self._abandoned.add(worker_id)
        self._live -= 1
        # at nice 19 the fresh worker that replaces it (a new schema after a storm of slow
        # ones) comes first for the cores
        _renice(self._tids.get(worker_id), 19)
        if (self._live + len(self._abandoned) < MAX_THREADS_PER_WORKER * self.num_workers
                and not self._closed):
            self._spawn()
