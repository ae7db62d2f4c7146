"""The periodic stats line: rates over the interval from two snapshots, nothing logged before an
interval has passed or over an idle one, the step phases logged and reset with it."""
from __future__ import annotations

import logging

from guided.outputs import EngineStats
from guided.serving.stats_log import CompileCounts, StatsLogger, stats_line
from guided.worker.step_times import StepTimes


def test_stats_line_reports_rates_over_the_interval():
    before = EngineStats(prompt_tokens_total=1000, generation_tokens_total=500,
                         forward_passes_total=10, prefix_cache_queries_total=1000,
                         prefix_cache_hit_tokens_total=0)
    now = EngineStats(num_running=7, num_waiting=3, kv_blocks_total=100, kv_blocks_in_use=25,
                      prompt_tokens_total=3000, generation_tokens_total=1500,
                      forward_passes_total=110, jump_forward_tokens_total=250,
                      prefix_cache_queries_total=3000, prefix_cache_hit_tokens_total=1500)
    line = stats_line(before, now, 2.0, CompileCounts(10, 6, 2), CompileCounts(2, 2, 0), 1.5)
    assert line.endswith("engine thread on a CPU 75% of the time")
    assert "running 7, waiting 3, compiling 2" in line
    assert "prompt 1000.0 tok/s, generation 500.0 tok/s, 50.0 forward passes/s" in line
    assert "jump-forward 25% of tokens" in line
    assert "KV 25% in use, prefix cache 75% hit" in line
    assert "grammar cache 50% hit of 8 asked" in line


def test_logger_waits_an_interval_and_skips_idle_ones(caplog):
    clock = [0.0]
    stats_log = StatsLogger(10.0, clock=lambda: clock[0])
    times = StepTimes()
    times.count("steps", 4)
    with times.phase("schedule"):
        pass
    busy = EngineStats(generation_tokens_total=100)
    with caplog.at_level(logging.INFO, logger="guided.stats"):
        assert not stats_log.maybe_log(EngineStats(), CompileCounts(), times)  # first look
        clock[0] = 5.0
        assert not stats_log.maybe_log(busy, CompileCounts(), times)  # too soon
        clock[0] = 12.0
        assert stats_log.maybe_log(busy, CompileCounts(), times)
        assert "generation 8.3 tok/s" in caplog.text and "step phases: per step:" in caplog.text
        assert not times.counts  # reset with the line
        clock[0] = 30.0
        assert not stats_log.maybe_log(busy, CompileCounts(), times)  # nothing happened
    assert StatsLogger(0.0).maybe_log(busy, CompileCounts()) is False
