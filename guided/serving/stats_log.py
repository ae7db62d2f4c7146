"""What the server is doing, logged every few seconds while it has work (as vLLM's "Avg prompt
throughput ..." line): requests running and waiting, prompt and generation tokens a second,
forward passes, jump-forward tokens, KV use, prefix-cache hits and compile waits over the
interval; and the engine's host time per step phase (guided/engine/step_times.py), which says where a
slow interval's time went (a step loop held up by compiles, mask fills or the device)."""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from guided.engine.heap import GcTimer
from guided.outputs import EngineStats
from guided.worker.step_times import StepTimes

logger = logging.getLogger("guided.stats")


@dataclass(frozen=True, slots=True)
class CompileCounts:
    """The front end's constraint compiles so far: asked, found compiled, still pending."""
    queries: int = 0
    hits: int = 0
    pending: int = 0


def _grown(before: float, now: float) -> float:
    """A counter's growth over the interval; a counter that went down was started again (a
    new engine, a new source), and all of its value is the interval's."""
    return now - before if now >= before else now


def stats_line(before: EngineStats, now: EngineStats, seconds: float,
               compiles: CompileCounts, compiles_before: CompileCounts,
               thread_seconds: float | None = None) -> str:
    """One interval's summary (pure: the two snapshots and the seconds between them;
    thread_seconds: the CPU time the engine thread had in them)."""
    seconds = max(seconds, 1e-9)
    prompt = _grown(before.prompt_tokens_total, now.prompt_tokens_total)
    generated = _grown(before.generation_tokens_total, now.generation_tokens_total)
    passes = _grown(before.forward_passes_total, now.forward_passes_total)
    forced = _grown(before.jump_forward_tokens_total, now.jump_forward_tokens_total)
    queried = _grown(before.prefix_cache_queries_total, now.prefix_cache_queries_total)
    hit = _grown(before.prefix_cache_hit_tokens_total, now.prefix_cache_hit_tokens_total)
    asked = _grown(compiles_before.queries, compiles.queries)
    found = _grown(compiles_before.hits, compiles.hits)
    if thread_seconds is not None:
        thread_seconds = max(thread_seconds, 0.0)
    kv = now.kv_blocks_in_use / now.kv_blocks_total if now.kv_blocks_total else 0.0
    return (f"running {now.num_running}, waiting {now.num_waiting}, compiling "
            f"{compiles.pending} | prompt {prompt / seconds:.1f} tok/s, generation "
            f"{generated / seconds:.1f} tok/s, {passes / seconds:.1f} forward passes/s, "
            f"jump-forward {forced / generated if generated else 0.0:.0%} of tokens | KV "
            f"{kv:.0%} in use, prefix cache {hit / queried if queried else 0.0:.0%} hit | "
            f"grammar cache {found / asked if asked else 0.0:.0%} hit of {asked} asked"
            + ("" if thread_seconds is None else
               # well under 100% while it has work: it waits (on the device, or for the GIL)
               f" | engine thread on a CPU {thread_seconds / seconds:.0%} of the time"))


def _read_stat(path: str) -> tuple[str, list[str]] | None:
    """A /proc stat file as (the command's name, the fields after it); None if it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rindex(")")
    return stat[stat.index("(") + 1:end], stat[end + 2:].split()


def _cpu_seconds(fields: list[str]) -> float:
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds each thread of this process has had (Linux: /proc/self/task; elsewhere
    empty), by native thread id, with its name: Python's where it is a Python thread, the
    kernel's otherwise (torch's, the tokenizer's)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        stat = _read_stat(f"/proc/self/task/{tid}/stat")
        if stat is not None:  # else the thread ended meanwhile
            out[int(tid)] = (names.get(int(tid)) or stat[0], _cpu_seconds(stat[1]))
    return out


def child_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds of each child process (Linux /proc; elsewhere empty), named by the module
    it runs (a worker's `-m guided.fsm.table_worker` is "table_worker") or its command."""
    me, out = os.getpid(), {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    for entry in entries:
        stat = _read_stat(f"/proc/{entry}/stat")
        if stat is None or int(stat[1][1]) != me:
            continue
        name = stat[0]
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and argv.index(b"-m") + 1 < len(argv):
            name = argv[argv.index(b"-m") + 1].decode(errors="replace").rsplit(".", 1)[-1]
        out[int(entry)] = (f"{name} (process)", _cpu_seconds(stat[1]))
    return out


def thread_group(name: str) -> str:
    """A thread's group: its name without a trailing number (grammar-compile-3 and
    grammar-compile-7 are grammar-compile)."""
    return re.sub(r"[-_]?\d+$", "", name) or name


def cpu_by_group(before: dict[int, tuple[str, float]], now: dict[int, tuple[str, float]],
                 seconds: float, top: int = 10) -> str:
    """The interval's CPU of threads (and processes) named alike, grammar-compile-3 and
    grammar-compile-7 as one group, in cores, busiest first (pure)."""
    groups: dict[str, list] = {}
    for tid, (name, cpu) in now.items():
        used = groups.setdefault(thread_group(name), [0, 0.0])
        used[0] += 1
        used[1] += cpu - _base(before, tid, name, cpu)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return ", ".join(f"{group} x{count} {cpu / max(seconds, 1e-9):.2f}"
                     for group, (count, cpu) in ranked if cpu > 0)


def run_delay_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux schedstat;
    None elsewhere): time off the CPU that is not a wait of its own (nor one for the GIL)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def throttled_seconds() -> float | None:
    """Seconds this process's cgroup has been held off every core by its CPU quota (cgroup v2
    or v1 cpu.stat; None where there is none): a quota spent by the compile threads stops the
    step loop too, whatever their niceness."""
    for path, key, scale in (("/sys/fs/cgroup/cpu.stat", "throttled_usec", 1e6),
                             ("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time", 1e9),
                             ("/sys/fs/cgroup/cpu,cpuacct/cpu.stat", "throttled_time", 1e9)):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value) / scale
        except (OSError, ValueError):
            continue
    return None


def _base(before: dict[int, tuple[str, float]], tid: int, name: str, cpu: float) -> float:
    """A thread's CPU at the interval's start; 0 for a thread id the kernel reused for a new
    thread (another name, or less CPU than the old one had)."""
    old_name, old_cpu = before.get(tid, (name, 0.0))
    return old_cpu if old_name == name and old_cpu <= cpu else 0.0


def busiest_threads(before: dict[int, tuple[str, float]], now: dict[int, tuple[str, float]],
                    seconds: float, top: int = 6) -> str:
    """The threads that had the most CPU between two thread_cpu_seconds(), as shares of the
    interval (pure)."""
    used = sorted(((cpu - _base(before, tid, name, cpu), name)
                   for tid, (name, cpu) in now.items()), reverse=True)
    return ", ".join(f"{name} {cpu / max(seconds, 1e-9):.0%}" for cpu, name in used[:top]
                     if cpu > 0)


def cpu_waits(run_delay_before: float | None, run_delay: float | None,
              throttled_before: float | None, throttled: float | None, seconds: float) -> str:
    """The engine thread's wait for a core and the cgroup's throttled time, as shares of the
    interval (pure; what is unknown is left out)."""
    seconds = max(seconds, 1e-9)
    parts = []
    # a counter that went down was read from another thread: unknown, left out
    if run_delay_before is not None and run_delay is not None and run_delay >= run_delay_before:
        parts.append(f"engine thread runnable without a core "
                     f"{(run_delay - run_delay_before) / seconds:.0%}")
    if throttled_before is not None and throttled is not None and throttled >= throttled_before:
        parts.append(f"cgroup throttled {(throttled - throttled_before) / seconds:.0%}")
    return ", ".join(parts)


class StatsLogger:
    """Logs stats_line (and the step phases) every interval_s seconds of an engine thread."""

    def __init__(self, interval_s: float, *, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last: EngineStats | None = None
        self._last_compiles = CompileCounts()
        self._last_thread_time = time.thread_time()  # of the thread that calls maybe_log
        self._gc = GcTimer() if interval_s > 0 else None
        self._threads = thread_cpu_seconds() if interval_s > 0 else {}
        self._children = child_cpu_seconds() if interval_s > 0 else {}
        self._run_delay = run_delay_seconds()
        self._throttled = throttled_seconds()

    def maybe_log(self, stats: EngineStats, compiles: CompileCounts,
                  step_times: StepTimes | None = None) -> bool:
        """Logs if an interval has passed and something happened in it; True if it logged."""
        if self.interval_s <= 0:
            return False
        now = self._clock()
        thread_time = time.thread_time()
        if self._last is None:  # the first call, on the engine's thread: every baseline here
            self._last, self._last_time, self._last_compiles = stats, now, compiles
            self._last_thread_time, self._run_delay = thread_time, run_delay_seconds()
            return False
        if now - self._last_time < self.interval_s:
            return False
        threads, children = thread_cpu_seconds(), child_cpu_seconds()
        run_delay, throttled = run_delay_seconds(), throttled_seconds()
        idle = (stats.generation_tokens_total == self._last.generation_tokens_total
                and stats.prompt_tokens_total == self._last.prompt_tokens_total)
        if not idle:
            logger.info("%s", stats_line(self._last, stats, now - self._last_time, compiles,
                                         self._last_compiles,
                                         thread_time - self._last_thread_time))
            if step_times is not None:
                logger.info("step phases: %s", step_times.summary())
            if self._gc is not None and self._gc.count:
                logger.info("python gc: %d collections (%d full), %.1f ms", self._gc.count,
                            self._gc.full, self._gc.seconds * 1e3)
            busiest = busiest_threads(self._threads, threads, now - self._last_time)
            if busiest:  # which threads the engine thread shares the GIL and the cores with
                logger.info("busiest threads: %s", busiest)
            groups = cpu_by_group({**self._threads, **self._children}, {**threads, **children},
                                  now - self._last_time)
            if groups:  # where the machine's cores went: this process's threads, its workers
                logger.info("cpu by thread group (cores): %s", groups)
            waits = cpu_waits(self._run_delay, run_delay, self._throttled, throttled,
                              now - self._last_time)
            if waits:
                logger.info("cpu waits: %s", waits)
        if self._gc is not None:
            self._gc.reset()
        if step_times is not None:
            step_times.reset()
        self._last, self._last_time, self._last_compiles = stats, now, compiles
        self._last_thread_time, self._threads = thread_time, threads
        self._children = children
        self._run_delay, self._throttled = run_delay, throttled
        return not idle

    def close(self) -> None:
        if self._gc is not None:
            self._gc.close()
