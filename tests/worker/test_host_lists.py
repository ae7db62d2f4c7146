"""list_tensor equals torch.tensor on the step's lists: ints (seeds up to 2**63 - 1), floats,
padded block tables, empty lists."""
from __future__ import annotations

import pytest
import torch

from guided.worker.host_lists import list_tensor


@pytest.mark.parametrize("values, dtype", [
    ([0, 5, 2**63 - 1, 17], torch.int64),
    ([[1, 2, 0], [3, 0, 0]], torch.int32),
    ([0.0, 0.7, 1.5], torch.float32),
    ([], torch.int64),
])
def test_list_tensor_equals_torch_tensor(values, dtype):
    ours, theirs = list_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs)


def test_list_tensor_refuses_what_does_not_fit():
    with pytest.raises(OverflowError):
        list_tensor([2**63], torch.int64)
