"""Snapshots: copies of the engine's outputs that it cannot change afterwards, sharing a history
that only grows; the finished output of a request ended from outside the engine."""
from __future__ import annotations

import dataclasses

from guided.outputs import RequestMetrics, RequestOutput, TokenLogprob
from guided.serving.snapshots import History, final_output, snapshot


def test_snapshot_copies_every_field():
    out = RequestOutput("r", [1, 2], [3, 4], "ab", finished=True, finish_reason="stop",
                        stop_reason="x", error="e", error_type="internal",
                        logprobs=[TokenLogprob(3, -0.1)],
                        metrics=RequestMetrics(arrival_time=1.0, forward_passes=2))
    snap = snapshot(out, History())
    assert dataclasses.asdict(snap) == dataclasses.asdict(out)
    assert snap == out and out == snap and repr(snap) == repr(out)
    out.token_ids.append(5)
    out.logprobs.append(TokenLogprob(5, -0.2))
    out.metrics.forward_passes = 3
    assert snap.token_ids == [3, 4] and len(snap.logprobs) == 1
    assert snap.metrics.forward_passes == 2
    assert isinstance(snap.token_ids, list) and snap != out


def test_snapshots_share_a_history_that_only_grows():
    history, live = History(), []
    snaps = []
    for token in range(6):  # an engine that hands out its live list (as the fake does)
        live.append(token)
        snaps.append(snapshot(RequestOutput("r", [9], live, "x"), history))
    assert [s.token_ids for s in snaps] == [list(range(n)) for n in range(1, 7)]
    assert snaps[0].logprobs is None
    live[:] = [7, 7, 7]  # not an extension (never from Engine): a fresh history list
    rewritten = snapshot(RequestOutput("r", [9], live, "x"), history)
    live.append(8)
    assert rewritten.token_ids == [7, 7, 7] and snaps[-1].token_ids == list(range(6))
    assert dataclasses.replace(rewritten, text="y").token_ids == [7, 7, 7]


def test_final_output_finishes_the_last_output_without_touching_it():
    last = snapshot(RequestOutput("r", [1], [3, 4], "ab", metrics=RequestMetrics(
        forward_passes=2)), History())
    final = final_output("r", last, "error", "it died", "internal")
    assert final.finished and final.finish_reason == "error" and final.error == "it died"
    assert final.token_ids == [3, 4] and final.text == "ab" and not last.finished
    assert final.metrics is not last.metrics
    empty = final_output("q", None, "abort")
    assert empty.finished and empty.finish_reason == "abort" and empty.token_ids == []
