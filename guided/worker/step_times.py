"""Host seconds per phase of a step, summed over steps (benchmarks and debug logs)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class StepTimes:
    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    def summary(self) -> str:
        steps = max(self.counts.get("steps", 0), 1)
        parts = [f"{k} {1e3 * v / steps:.2f} ms" for k, v in sorted(self.seconds.items())]
        counts = [f"{k} {v}" for k, v in sorted(self.counts.items())]
        return "per step: " + ", ".join(parts) + " | " + ", ".join(counts)
