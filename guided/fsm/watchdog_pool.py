"""A bounded thread pool whose jobs (grammar compiles) have a deadline, and the lowered priority
its threads run at. A C++ compile cannot be interrupted, so a job past its deadline is
abandoned: its owner is told (or its future fails) at once and a fresh worker replaces it; so is
a job its owner drops while it runs, whose thread then runs at the lowest priority until its
compile ends. With max_wait_s, queued jobs that would not start within it are cancelled (shed)
rather than left to time out, except those submitted not sheddable (an offline batch's: a
forecast shed 95 of 128 schemas such a batch submitted at once on a busy 2-core host)."""
from __future__ import annotations

import heapq
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
# threads (live and abandoned) per worker: a storm of compiles past their deadline leaves
# 3 x num_workers abandoned at nice 19 before new specs would wait for one of them to end
MAX_THREADS_PER_WORKER = 4
# the typical duration's memory: each finished job moves it this far towards its duration
_DURATION_WEIGHT = 0.2
# with max_wait_s: how often the watchdog looks at a queue for jobs that can no longer start in
# time (a storm's refusals come this soon once its running compiles show they are slow)
_SHED_EVERY_S = 0.2


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

    Invariants: live workers <= num_workers; live + abandoned (timed out or dropped, still
    running) <= MAX_THREADS_PER_WORKER x num_workers, so stuck compiles shrink the pool rather
    than grow the thread
    count; an abandoned worker exits when its job ends, replaced if the pool is short.
    """

    def __init__(self, *, num_workers: int, timeout_s: float, nice: int = 0,
                 idle: bool = False, name: str = "grammar-compile",
                 max_wait_s: float | None = None):
        self.num_workers = max(1, num_workers)
        self.name = name  # its threads' (the server's stats log names the busiest)
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s  # None: queued jobs wait however long it takes
        self.nice = nice
        self.idle = idle  # SCHED_IDLE (lower_thread_priority)
        self._cond = threading.Condition()
        # queued: (future, fn, label, on_overdue, sheddable)
        self._jobs: list[tuple[Future, Callable[[], Any], str, Callable[[], None] | None,
                               bool]] = []
        self._deadlines: list[tuple[float, int, int]] = []  # heap: (deadline, job id, worker id)
        # worker id -> its current job: (future, label, job id, on_overdue, start time)
        self._running: dict[int, tuple[Future, str, int, Callable[[], None] | None, float]] = {}
        self._tids: dict[int, int] = {}  # worker id -> its thread's native id (renice)
        self._abandoned: set[int] = set()
        # how long a job holds a worker (at most timeout_s: then it is abandoned), moving average
        self._mean_s: float | None = None
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
        """Worker threads alive: never more than MAX_THREADS_PER_WORKER x num_workers."""
        with self._cond:
            return self._live + len(self._abandoned)

    def room(self) -> float:
        """How many more jobs could queue now and still start within max_wait_s (unbounded
        without it); 0 where no live worker is left (abandoned threads at their bound)."""
        with self._cond:
            return self._start_limit(time.monotonic()) - len(self._jobs)

    def _start_limit(self, now: float) -> float:  # caller holds the lock
        """How many queued jobs can start within max_wait_s: one per idle live worker now, then
        one per live worker each typical job duration (the recent mean, or what the running
        jobs have taken so far where that is longer: a storm's first compiles show it before
        any ends), a worker being freed within timeout_s at the latest."""
        if self.max_wait_s is None:
            return math.inf
        elapsed = [now - job[4] for w, job in self._running.items() if w not in self._abandoned]
        typical = min(self.timeout_s, max(self._mean_s or 0.0,
                                          statistics.median(elapsed) if elapsed else 0.0))
        if typical <= 0:  # nothing measured yet
            return math.inf if self._live else 0
        rounds = math.ceil(self.max_wait_s / typical) - 1  # starts at k x typical < max_wait_s
        return max(0, self._live - len(elapsed)) + self._live * rounds

    def submit(self, future: Future, fn: Callable[[], Any], *, label: str = "job",
               on_overdue: Callable[[], None] | None = None, sheddable: bool = True) -> None:
        """Run fn() for future. Past timeout_s of running: on_overdue() if given (the future is
        left to the job, which may still finish it), else the future fails. sheddable: it may
        be cancelled while queued, where it would not start within max_wait_s."""
        with self._cond:
            if self._closed:
                future.set_exception(ConstraintError("the grammar compiler is shut down"))
                return
            self._jobs.append((future, fn, label, on_overdue, sheddable))
            self._cond.notify_all()

    def drop(self, future: Future) -> None:
        """Nobody waits for future's job any more: a queued job is removed (the future
        cancelled); a running one is abandoned (a fresh worker replaces it, within the thread
        bound) and its thread reniced to 19 until its job ends."""
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
            _settle(future, None, ConstraintError("the grammar compiler is shut down"))

    def _spawn(self) -> None:  # caller holds the lock (or is __init__)
        self._live += 1
        worker_id = next(self._ids)
        threading.Thread(target=self._work, args=(worker_id,), name=f"{self.name}-{worker_id}",
                         daemon=True).start()

    def _work(self, worker_id: int) -> None:
        lower_thread_priority(self.nice, self.idle)
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
                job_id = next(self._ids)
                started = time.monotonic()
                self._running[worker_id] = (future, label, job_id, on_overdue, started)
                heapq.heappush(self._deadlines, (started + self.timeout_s, job_id, worker_id))
                self._cond.notify_all()  # wake the watchdog for the new deadline
            try:
                result, error = fn(), None
            except ConstraintError as e:
                result, error = None, e
            except Exception as e:  # a backend bug must fail the request, never the engine
                result, error = None, ConstraintError(f"{label} failed to compile: {e!r}")
            # outside the lock: the future's callbacks may take their owner's lock, which may
            # be held by a thread waiting for this one (submit)
            _settle(future, result, error)
            with self._cond:
                self._running.pop(worker_id, None)
                if worker_id not in self._abandoned:  # (an abandoned one counted timeout_s)
                    self._observe(time.monotonic() - started)
                else:
                    # it may run at the lowest priority (dropped), which it cannot undo: a fresh
                    # worker takes its place where the thread bound kept the pool short
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
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, job_id, worker_id = heapq.heappop(self._deadlines)
                    overdue.extend(self._expire(worker_id, job_id))
                while self._deadlines and not self._is_running(*self._deadlines[0][1:]):
                    heapq.heappop(self._deadlines)  # finished in time
                limit = self._start_limit(now)
                excess = len(self._jobs) - limit
                for i in range(len(self._jobs) - 1, -1, -1):  # the newest go: the first come
                    if excess <= 0:  # keep their turn
                        break
                    if self._jobs[i][4]:
                        shed.append(self._jobs.pop(i)[0])
                        excess -= 1
                if not overdue:
                    wait = self._deadlines[0][0] - now if self._deadlines else None
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

    def _is_running(self, job_id: int, worker_id: int) -> bool:
        running = self._running.get(worker_id)
        return running is not None and running[2] == job_id

    def _expire(self, worker_id: int, job_id: int) -> list[Callable[[], None]]:
        """(caller holds the lock) What to call, outside the lock, for an overdue job: its
        overdue callback, else the failure of its future."""
        if not self._is_running(job_id, worker_id) or worker_id in self._abandoned:
            return []
        future, label, _, on_overdue, _ = self._running[worker_id]
        self._observe(self.timeout_s)  # it held its worker that long
        self._abandon(worker_id)
        if on_overdue is not None:
            return [on_overdue]
        error = ConstraintError(
            f"{label} compile timed out after {self.timeout_s:g} s (compile_timeout_s)")
        return [lambda: _settle(future, None, error)]

    def _abandon(self, worker_id: int) -> None:  # caller holds the lock
        self._abandoned.add(worker_id)
        self._live -= 1
        # an abandoned job runs on at the lowest priority: the fresh worker that replaces it
        # (a new schema after a storm of slow ones) comes first for the cores
        _renice(self._tids.get(worker_id), 19)
        if (self._live + len(self._abandoned) < MAX_THREADS_PER_WORKER * self.num_workers
                and not self._closed):
            self._spawn()


def _settle(future: Future, result: Any, error: BaseException | None) -> None:
    """Settle future unless it is settled already (a timeout, a cancel)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


def _renice(tid: int | None, niceness: int) -> None:
    """Set a thread's niceness (only ever raised: lowering it needs privileges). Best effort."""
    if tid is None or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(niceness, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass
