"""worker/host_bitmasks.py: pinned mask buffers reused in turn, each only after its copy ran."""
from __future__ import annotations

import pytest
import torch

from guided.worker.host_bitmasks import MIN_ROWS, HostBitmasks


def test_buffers_are_reused_in_turn_and_grow():
    masks = HostBitmasks(7, torch.device("cpu"))
    a, b = masks.take(3), masks.take(5)
    assert a.shape == (3, 7) and b.shape == (5, 7) and a.dtype == torch.int32
    assert a.is_contiguous() and b.is_contiguous()
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    again = masks.take(MIN_ROWS)  # the first buffer again, no new allocation
    assert again.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    bigger = masks.take(MIN_ROWS + 1)  # the second buffer, grown
    assert bigger.shape == (MIN_ROWS + 1, 7)
    assert masks.to_device(bigger) is bigger  # on the CPU the rows are used where they are


@pytest.mark.gpu
def test_a_buffer_is_taken_again_only_after_its_copy_ran():
    masks = HostBitmasks(1024, torch.device("cuda"))
    first = masks.take(256)
    assert first.is_pinned()
    first.fill_(7)
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the copy is still queued
    on_device = masks.to_device(first)
    masks.take(256)
    reused = masks.take(256)  # waits for the copy out of `first`
    assert reused.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    reused.fill_(0)
    torch.cuda.synchronize()
    assert (on_device == 7).all()
