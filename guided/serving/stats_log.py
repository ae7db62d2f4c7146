"""What the server is doing, logged every few seconds while it has work (as vLLM's "Avg prompt
throughput ..." line): requests running and waiting, prompt and generation tokens a second,
forward passes, jump-forward tokens, KV use, prefix-cache hits and compile waits over the
interval; and the engine's host time per step phase (guided/worker/step_times.py), which says where a
slow interval's time went (a step loop held up by compiles, mask fills or the device)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

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


class StatsLogger:
    """Logs stats_line (and the step phases) every interval_s seconds of an engine thread."""

    def __init__(self, interval_s: float, *, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last_time = clock()
        self._last: EngineStats | None = None
        self._last_compiles = CompileCounts()
        self._last_thread_time = time.thread_time()  # of the thread that calls maybe_log

    def maybe_log(self, stats: EngineStats, compiles: CompileCounts,
                  step_times: StepTimes | None = None) -> bool:
        """Logs if an interval has passed and something happened in it; True if it logged."""
        if self.interval_s <= 0:
            return False
        now = self._clock()
        thread_time = time.thread_time()
        if self._last is None:  # the first call, on the engine's thread: every baseline here
            self._last, self._last_time, self._last_compiles = stats, now, compiles
            self._last_thread_time = thread_time
            return False
        if now - self._last_time < self.interval_s:
            return False
        idle = (stats.generation_tokens_total == self._last.generation_tokens_total
                and stats.prompt_tokens_total == self._last.prompt_tokens_total)
        if not idle:
            logger.info("%s", stats_line(self._last, stats, now - self._last_time, compiles,
                                         self._last_compiles,
                                         thread_time - self._last_thread_time))
            if step_times is not None:
                logger.info("step phases: %s", step_times.summary())
        if step_times is not None:
            step_times.reset()
        self._last, self._last_time, self._last_compiles = stats, now, compiles
        self._last_thread_time = thread_time
        return not idle
