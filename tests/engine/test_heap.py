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


def test_frozen_cycles_are_freed_before_the_interpreter_exits():
    """An engine never shut down (LLM() in a script): its frozen cycles are collected at exit,
    while modules are still alive (else nanobind's modules report them as leaks)."""
    import subprocess
    import sys

    script = ("from guided.engine.heap import freeze_startup_heap\n"
              "class Node:\n"
              "    def __del__(self):\n"
              "        print('freed', flush=True)\n"
              "node = Node(); node.self = node\n"
              "freeze_startup_heap()\n"
              "del node\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "freed\n", out
