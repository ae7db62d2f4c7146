"""Python's cyclic garbage collector and a loaded engine.

A full collection walks every object alive, and after start-up that is ~350k of them
(torch, transformers, the tokenizer's tables, the compiled model's graphs): measured on an H100
host, 0.54 s of one 2 s offline run went to collections (benchmarks/RESULTS.md, session 16), a
stall of the whole step loop each time. The objects made during start-up live as long as the
engine, so they are moved out of the collector's reach once it is ready (gc.freeze, as vLLM does
after start-up); the step loop's own garbage is collected as before."""
from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000  # net container allocations between young collections


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survives (gc.freeze: never traversed again). Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    # an engine never shut down (LLM() in a script, `guided generate`) would keep its frozen
    # cycles past the interpreter's finalization, and nanobind modules (triton's) then print
    # ~80 lines of "leaked instances" at exit: thaw and collect before the modules go
    atexit.unregister(_collect_at_exit)
    atexit.register(_collect_at_exit)
    # a step makes hundreds of short-lived containers (freed by their counts, not by the
    # collector): at the default 700 a young collection ran about once a step, ~0.35 ms each
    # with the step's data alive (H100 host, RESULTS session 16)
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the cyclic collector", frozen)
    return frozen


def _collect_at_exit() -> None:
    gc.unfreeze()
    gc.collect()


def thaw_heap() -> None:
    """Frozen objects back in the collector's reach (an engine shut down: its cycles, frozen
    with the rest, would otherwise never be freed)."""
    gc.unfreeze()
