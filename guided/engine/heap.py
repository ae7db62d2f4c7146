"""The engine's start-up objects (~350k: torch, transformers, the tokenizer, compiled graphs)
live as long as it does, so they are frozen out of the cyclic collector once it is ready (as
vLLM does): a full collection walking them stalled the step loop (0.54 s of a 2 s offline run on
an H100 host). The step loop's own garbage is collected as before."""
from __future__ import annotations

import atexit
import gc

# net container allocations between young collections: a step makes hundreds of short-lived
# ones, and at the default 700 a young collection (~0.35 ms) ran about once a step
YOUNG_THRESHOLD = 20_000


def freeze_startup_heap() -> int:
    """Collect once, freeze what survives; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    # an engine never shut down would keep its frozen cycles past finalization, and nanobind
    # modules (triton's) then print "leaked instances" at exit: thaw and collect before
    atexit.unregister(_collect_at_exit)
    atexit.register(_collect_at_exit)
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    return gc.get_freeze_count()


def _collect_at_exit() -> None:
    gc.unfreeze()
    gc.collect()


def thaw_heap() -> None:
    """A shut-down engine's frozen cycles back in the collector's reach."""
    gc.unfreeze()
