"""Where the device's time goes between the host's launches: CUDA events recorded on the
stream at the start and end of each forward pass and each sampling, read once at the end.

An event's time is when the device reaches it, so the span from one mark to the next is the
device's work queued between them plus any time its queue stood empty. Nothing is queued
between a forward's end and its sampling's start, nor between a sampling's end and the next
forward's start, except the host's small copies: those spans are the device waiting on the
host (the mask fill, the next step's preparation). A profiler's kernel sums cannot show them.

Off by default (EngineConfig.device_timeline); benchmarks/engine_offline.py prints it."""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch

MAX_MARKS = 40_000  # a run's marks kept (four a step); past it new marks are dropped


class DeviceTimeline:
    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self._marks: list[tuple[str, torch.cuda.Event, int]] = []
        self.call = 0  # set by whoever drives the steps: each mark keeps the call it came in

    def mark(self, label: str) -> None:
        if self.enabled and len(self._marks) < MAX_MARKS:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((label, event, self.call))

    def reset(self) -> None:
        self._marks.clear()

    def spans(self) -> dict[str, list[float]]:
        """Milliseconds between consecutive marks, by "from -> to" label."""
        out: dict[str, list[float]] = defaultdict(list)
        for label, ms, _ in self.timed_spans():
            out[label].append(ms)
        return out

    def timed_spans(self) -> list[tuple[str, float, int]]:
        """(label, milliseconds, the call of the span's closing mark) in the device's order."""
        if not self._marks:
            return []
        self._marks[-1][1].synchronize()
        return [(f"{a} -> {b}", ea.elapsed_time(eb), call)
                for (a, ea, _), (b, eb, call) in zip(self._marks, self._marks[1:])]

    def longest_waits(self, n: int) -> list[tuple[float, int]]:
        """The n longest spans where the device waited for a sampling launch: (ms, call)."""
        waits = [(ms, call) for label, ms, call in self.timed_spans()
                 if label.endswith("-> sample")]
        return sorted(waits, reverse=True)[:n]

    def summary(self) -> str:
        """Per span: count, total ms, mean and p90 ms; the spans sorted by total."""
        spans = self.spans()
        if not spans:
            return "device timeline: no marks"
        parts = []
        for label, ms in sorted(spans.items(), key=lambda kv: -sum(kv[1])):
            p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
            parts.append(f"{label}: {len(ms)}x {sum(ms):.0f} ms (mean {statistics.fmean(ms):.3f},"
                         f" p90 {p90:.3f})")
        return "device timeline: " + "; ".join(parts)
