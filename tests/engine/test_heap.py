"""Start-up objects frozen out of the cyclic collector, and thawed at shutdown."""
from __future__ import annotations

import gc
import weakref

from guided.engine.heap import freeze_startup_heap, thaw_heap


class _Node:
    pass


def test_frozen_cycles_wait_for_the_thaw():
    node = _Node()
    node.self = node  # a cycle: only the cyclic collector frees it
    alive = weakref.ref(node)
    try:
        assert freeze_startup_heap() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: the collector no longer walks it
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
