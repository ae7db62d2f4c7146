"""The periodic stats line: rates over the interval from two snapshots, nothing logged before an
interval has passed or over an idle one, the step phases logged and reset with it."""
from __future__ import annotations

import logging

from guided.outputs import EngineStats
from guided.serving.stats_log import (
    CompileCounts,
    StatsLogger,
    busiest_threads,
    child_cpu_seconds,
    cpu_by_group,
    cpu_waits,
    stats_line,
    thread_cpu_seconds,
)
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
    stats_log.close()


def test_gc_collections_are_logged(caplog):
    import gc

    clock = [0.0]
    stats_log = StatsLogger(1.0, clock=lambda: clock[0])
    stats_log.maybe_log(EngineStats(), CompileCounts())
    gc.collect()
    clock[0] = 2.0
    with caplog.at_level(logging.INFO, logger="guided.stats"):
        stats_log.maybe_log(EngineStats(generation_tokens_total=1), CompileCounts())
    stats_log.close()
    assert "python gc: 1 collections (1 full)" in caplog.text


def test_busiest_threads_ranks_the_interval_cpu():
    before = {1: ("engine", 1.0), 2: ("compile", 0.5)}
    now = {1: ("engine", 1.5), 2: ("compile", 2.5), 3: ("new", 0.25)}
    assert busiest_threads(before, now, 2.0, top=2) == "compile 100%, engine 25%"


def test_cpu_by_group_sums_threads_named_alike_in_cores():
    before = {1: ("grammar-compile-0", 1.0), 2: ("grammar-compile-1", 1.0), 3: ("engine", 0.0)}
    now = {1: ("grammar-compile-0", 2.0), 2: ("grammar-compile-1", 2.5), 3: ("engine", 1.5),
           4: ("table_worker (process)", 0.5), 5: ("idle", 0.0)}
    assert cpu_by_group(before, now, 1.0) == (
        "grammar-compile x2 2.50, engine x1 1.50, table_worker (process) x1 0.50")


def test_child_cpu_seconds_names_a_worker_by_its_module():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "json.tool"], stdin=subprocess.PIPE)
    try:
        names = [name for name, _ in child_cpu_seconds().values()]
    finally:
        child.communicate(b"{}")
    if sys.platform.startswith("linux"):
        assert "tool (process)" in names


def test_thread_cpu_seconds_names_this_thread():
    import sys
    import threading

    threads = thread_cpu_seconds()
    if not sys.platform.startswith("linux"):
        assert threads == {}
        return
    name, cpu = threads[threading.get_native_id()]
    assert name == threading.current_thread().name and cpu >= 0


def test_cpu_waits_are_shares_of_the_interval_and_leave_out_what_is_unknown():
    assert cpu_waits(1.0, 1.5, 2.0, 2.2, 2.0) == (
        "engine thread runnable without a core 25%, cgroup throttled 10%")
    assert cpu_waits(None, 1.5, 2.0, 2.2, 2.0) == "cgroup throttled 10%"
    assert cpu_waits(1.0, 1.5, None, None, 2.0) == "engine thread runnable without a core 25%"
    assert cpu_waits(None, None, None, None, 2.0) == ""


def test_no_negative_shares_from_counters_that_went_down():
    """A counter read from another thread or source (it went down) never gives a negative
    share: the stats log once printed "-244%"."""
    high = EngineStats(generation_tokens_total=900, prompt_tokens_total=900,
                       jump_forward_tokens_total=800, prefix_cache_queries_total=900,
                       prefix_cache_hit_tokens_total=800, forward_passes_total=900)
    low = EngineStats(generation_tokens_total=100, prompt_tokens_total=100,
                      jump_forward_tokens_total=50, prefix_cache_queries_total=100,
                      prefix_cache_hit_tokens_total=50, forward_passes_total=100)
    line = stats_line(high, low, 1.0, CompileCounts(1, 1, 0), CompileCounts(5, 5, 0), -2.44)
    assert "-" not in line.replace("jump-forward", "").replace("tok/s", ""), line
    assert "-" not in cpu_waits(5.0, 1.0, 3.0, 1.0, 1.0)
    reused = {7: ("grammar-compile-1", 9.0)}
    assert "-" not in busiest_threads(reused, {7: ("tokenizer", 2.0)}, 1.0)
    assert cpu_by_group(reused, {7: ("tokenizer", 2.0)}, 1.0) == "tokenizer x1 2.00"


def test_first_interval_measures_the_engine_thread_from_its_own_baseline(monkeypatch):
    """The logger is made on one thread and called on the engine's: the first call takes every
    per-thread baseline (run delay, thread time) on the calling thread."""
    import threading

    import guided.serving.stats_log as stats_log

    delays = {"made-here": 50.0}
    monkeypatch.setattr(stats_log, "run_delay_seconds",
                        lambda: delays.get(threading.current_thread().name, 1.0))
    t = [0.0]
    logger = StatsLogger(1.0, clock=lambda: t[0])
    seen = []

    def engine_thread():
        logger.maybe_log(EngineStats(), CompileCounts())
        t[0] = 2.0
        delays["engine"] = 1.5
        seen.append(logger._run_delay)
        logger.maybe_log(EngineStats(generation_tokens_total=10), CompileCounts())

    thread = threading.Thread(target=engine_thread, name="engine")
    threading.current_thread().name, old = "made-here", threading.current_thread().name
    try:
        thread.start()
        thread.join()
    finally:
        threading.current_thread().name = old
    assert seen == [1.0]  # not the 50 s of the thread that made the logger
