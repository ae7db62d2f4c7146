"""Python lists to CPU tensors and back, the fast way."""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def list_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) at about a third of the cost for long lists: numpy
    converts Python numbers without torch's per-element dispatch. A step at 256 requests builds
    ~10 such tensors, a 256 x 48 block table among them (benchmarks/bench_host_lists.py)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


def list_later(values: torch.Tensor) -> Callable[[], list]:
    """Queue a device tensor's copy to the host now; the returned call waits for that copy
    alone and gives its list (a .tolist() later would wait for all work queued after it), the
    same list on every call."""
    if values.device.type != "cuda":
        return functools.cache(values.tolist)
    host = to_pinned(values)
    copied = torch.cuda.Event()
    copied.record()
    return functools.cache(lambda: (copied.synchronize(), host.tolist())[1])


def to_pinned(values: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy to pinned host memory, queued (not waited for)."""
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host
