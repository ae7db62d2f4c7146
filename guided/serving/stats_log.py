"""What the server is doing, logged every few seconds while it has work (as vLLM's "Avg prompt
throughput ..." line), and the engine's host time per step phase (guided/worker/step_times.py),
which says where a slow interval's time went (compiles, mask fills or the device)."""
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
               thread_seconds: float) -> str:
    """One interval's summary from two snapshots, the seconds between them and the CPU time
    the engine thread had in them."""
    seconds = max(seconds, 1e-9)
    prompt = _grown(before.prompt_tokens_total, now.prompt_tokens_total)
    generated = _grown(before.generation_tokens_total, now.generation_tokens_total)
    passes = _grown(before.forward_passes_total, now.forward_passes_total)
    forced = _grown(before.jump_forward_tokens_total, now.jump_forward_tokens_total)
    queried = _grown(before.prefix_cache_queries_total, now.prefix_cache_queries_total)
    hit = _grown(before.prefix_cache_hit_tokens_total, now.prefix_cache_hit_tokens_total)
    asked = _grown(compiles_before.queries, compiles.queries)
    found = _grown(compiles_before.hits, compiles.hits)
    kv = now.kv_blocks_in_use / now.kv_blocks_total if now.kv_blocks_total else 0.0
    return (f"running {now.num_running}, waiting {now.num_waiting}, compiling "
            f"{compiles.pending} | prompt {prompt / seconds:.1f} tok/s, generation "
            f"{generated / seconds:.1f} tok/s, {passes / seconds:.1f} forward passes/s, "
            f"jump-forward {forced / generated if generated else 0.0:.0%} of tokens | KV "
            f"{kv:.0%} in use, prefix cache {hit / queried if queried else 0.0:.0%} hit | "
            f"grammar cache {found / asked if asked else 0.0:.0%} hit of {asked} asked"
            # well under 100% while it has work: it waits (on the device, or for the GIL)
            f" | engine thread on a CPU {max(thread_seconds, 0.0) / seconds:.0%} of the time")


class StatsLogger:
    """Logs stats_line (and the step phases) every interval_s seconds of an engine thread."""

    def __init__(self, interval_s: float, *, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        # at the last look: stats, clock, compile counts, the calling thread's CPU time
        self._last: tuple[EngineStats, float, CompileCounts, float] | None = None

    def maybe_log(self, stats: EngineStats, compiles: CompileCounts,
                  step_times: StepTimes | None = None) -> bool:
        """Logs if an interval has passed and something happened in it; True if it logged."""
        if self.interval_s <= 0:
            return False
        now, thread_time = self._clock(), time.thread_time()
        busy = False
        if self._last is not None:  # the first call (on the engine's thread) is the baseline
            last, last_time, last_compiles, last_thread_time = self._last
            if now - last_time < self.interval_s:
                return False
            busy = (stats.generation_tokens_total != last.generation_tokens_total
                    or stats.prompt_tokens_total != last.prompt_tokens_total)
            if busy:
                logger.info("%s", stats_line(last, stats, now - last_time, compiles,
                                             last_compiles, thread_time - last_thread_time))
                if step_times is not None:
                    logger.info("step phases: %s", step_times.summary())
            if step_times is not None:
                step_times.reset()
        self._last = (stats, now, compiles, thread_time)
        return busy
