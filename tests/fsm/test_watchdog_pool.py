from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import pytest

from guided.errors import ConstraintError
from guided.fsm.watchdog_pool import MAX_THREADS_PER_WORKER, WatchdogPool


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_queued_jobs_that_cannot_start_in_time_are_shed_newest_first():
    pool = WatchdogPool(num_workers=1, timeout_s=30, max_wait_s=3.0)
    release = threading.Event()
    running, first, second, third = (Future() for _ in range(4))
    pool.submit(running, lambda: release.wait(30))
    wait_until(running.running)
    for future in (first, second, third):
        pool.submit(future, lambda: "done")
    # nothing has shown how long a job takes yet: all may queue
    assert pool.num_queued == 3 and pool.room() > 0
    # the running job has taken 1.5 s: one more round of 1.5 s fits in 3 s, for one job
    wait_until(lambda: second.cancelled() and third.cancelled())
    assert not first.done() and pool.room() == 0
    release.set()
    assert first.result(timeout=10) == "done"  # the first come kept its turn
    pool.shutdown()


def test_after_a_storm_of_overdue_jobs_a_new_job_starts_at_once():
    pool = WatchdogPool(num_workers=2, timeout_s=0.2, max_wait_s=0.2)
    release = threading.Event()
    stuck = [Future() for _ in range(2)]
    for future in stuck:
        pool.submit(future, lambda: release.wait(30), label="stuck")
    for future in stuck:
        with pytest.raises(ConstraintError, match="timed out"):
            future.result(timeout=10)
    # each held its worker the whole timeout, and fresh workers replaced them: a new job may
    # take an idle one, never a queue behind the abandoned
    wait_until(lambda: pool.room() == 2)
    quick = Future()
    start = time.monotonic()
    pool.submit(quick, lambda: "quick")
    assert quick.result(timeout=10) == "quick" and time.monotonic() - start < 1.0
    assert pool.num_abandoned == 2
    release.set()
    wait_until(lambda: pool.num_abandoned == 0)
    pool.shutdown()


def test_without_max_wait_jobs_queue_however_long():
    pool = WatchdogPool(num_workers=1, timeout_s=30)
    release = threading.Event()
    futures = [Future() for _ in range(3)]
    for future in futures:
        pool.submit(future, lambda: release.wait(30))
    time.sleep(0.5)
    assert pool.num_queued == 2 and not any(f.cancelled() for f in futures)
    release.set()
    for future in futures:
        assert future.result(timeout=10) is True
    pool.shutdown()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are Linux's")
def test_compile_workers_run_at_a_lower_priority_than_the_caller():
    pool = WatchdogPool(num_workers=1, timeout_s=10, nice=5)
    niceness = Future()
    pool.submit(niceness, lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness.result(timeout=10) == min(19, mine + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # caller unchanged
    pool.shutdown()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_idle_compile_workers_run_under_sched_idle_and_the_caller_does_not():
    pool = WatchdogPool(num_workers=1, timeout_s=10, idle=True)
    policy = Future()
    pool.submit(policy, lambda: os.sched_getscheduler(threading.get_native_id()))
    assert policy.result(timeout=10) == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
    pool.shutdown()


def test_watchdog_bounds_abandoned_threads():
    pool = WatchdogPool(num_workers=1, timeout_s=0.1)
    release = threading.Event()
    futures = [Future() for _ in range(MAX_THREADS_PER_WORKER + 3)]
    for f in futures:
        pool.submit(f, lambda: release.wait(10), label="stuck")
    time.sleep(0.2 * len(futures))
    # stuck threads stay bounded: the pool shrinks to no live worker rather than grow
    assert pool.num_threads == MAX_THREADS_PER_WORKER
    assert pool.num_abandoned == MAX_THREADS_PER_WORKER and pool.num_queued == 3
    release.set()
    with pytest.raises(ConstraintError, match="timed out"):
        futures[0].result(timeout=10)
    for f in futures[1:]:
        f.exception(timeout=10)  # each one finishes: timed out, or ran once workers were free
    pool.shutdown()


def test_jobs_submitted_not_sheddable_wait_however_long():
    """An offline batch's compiles: queued behind a slow job past any forecast, never shed."""
    pool = WatchdogPool(num_workers=1, timeout_s=30, max_wait_s=1.0)
    release = threading.Event()
    running = Future()
    pool.submit(running, lambda: release.wait(30))
    wait_until(running.running)
    kept = [Future() for _ in range(3)]
    for k, future in enumerate(kept):
        pool.submit(future, lambda k=k: k, sheddable=False)
    shed = Future()
    pool.submit(shed, lambda: "late")
    wait_until(shed.cancelled)  # the running job outlasts max_wait_s: the sheddable one goes
    assert pool.num_queued == 3 and not any(f.done() for f in kept)
    release.set()
    assert [f.result(timeout=10) for f in kept] == [0, 1, 2]
    pool.shutdown()
