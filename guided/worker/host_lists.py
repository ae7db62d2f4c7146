"""Python lists to CPU tensors, the fast way."""
from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def list_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) at about a third of the cost for long lists: numpy
    converts Python numbers without torch's per-element dispatch. A step at 256 requests builds
    ~10 such tensors, a 256 x 48 block table among them (benchmarks/bench_host_lists.py)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))
