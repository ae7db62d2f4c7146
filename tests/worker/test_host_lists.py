"""list_tensor equals torch.tensor on the step's lists: ints (seeds up to 2**63 - 1), floats,
padded block tables, empty lists."""
from __future__ import annotations

import pytest
import torch

from guided.worker.host_lists import list_later, list_tensor


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


def test_list_later_reads_the_values_when_called():
    values = torch.arange(7, dtype=torch.int64)
    assert list_later(values)() == list(range(7))


@pytest.mark.gpu
def test_list_later_copies_what_was_queued_before_it():
    """The copy is queued at the call: work queued after it (the next step's forward pass)
    neither changes what it reads nor has to finish first."""
    values = torch.arange(1024, device="cuda")
    later = list_later(values)
    values.add_(1)  # queued after the copy
    assert later() == list(range(1024))
