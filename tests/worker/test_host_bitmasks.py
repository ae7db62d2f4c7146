import mmap
import os

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


def test_shared_buffers_are_files_another_mapping_sees_and_removed_on_release():
    masks = HostBitmasks(5, torch.device("cpu"), shared=True)
    rows = masks.take(3)
    path, capacity = masks.segment_of(rows)
    assert capacity == MIN_ROWS and masks.segment_of(torch.zeros(3, 5)) is None
    with open(path, "r+b") as f:  # what a mask shard does
        other = torch.frombuffer(mmap.mmap(f.fileno(), 0), dtype=torch.int32).view(capacity, 5)
    other[2, 4] = 12345
    assert rows[2, 4] == 12345
    grown = masks.take(3)  # the second buffer: a second file
    assert masks.segment_of(grown)[0] != path
    masks.release()
    assert not os.path.exists(path)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_a_buffer_is_taken_again_only_after_its_copy_ran(shared):
    masks = HostBitmasks(1024, torch.device("cuda"), shared=shared)
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
