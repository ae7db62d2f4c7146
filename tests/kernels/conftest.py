"""Kernel tests run the Triton kernels in the interpreter on the CPU; on a CUDA machine the same
tests run the compiled kernels on the GPU.

triton reads TRITON_INTERPRET when a kernel is decorated, so the kernel modules are (re)imported
here with it set; it is then cleared again and set only around each test of this directory, so
that other tests in the session keep the engine's CPU path (the torch references).
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

INTERPRET = not torch.cuda.is_available()

if INTERPRET:
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("guided.kernels.bitmask", "guided.kernels.attention", "guided.kernels.rope_kv",
                  "guided.kernels.silu_mul"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
        else:
            importlib.import_module(_name)
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cpu" if INTERPRET else "cuda"
