"""Mask rows in shared memory: what the engine fills is what a rank reads; a slot is refilled only
once every rank has copied its last rows out; a grown slot moves to a new segment."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guided.worker.shared_bitmasks import MIN_ROWS, NUM_SLOTS, MaskReader, SharedBitmasks

WORDS = 1537  # ceil(49_179 / 32): not a power of two


class RankStalled(Exception):
    pass


def test_filled_rows_reach_every_rank_and_slots_wait_for_the_slowest():
    shared = SharedBitmasks(WORDS, num_ranks=2)
    readers = [MaskReader(r, shared.consumed_path, WORDS, 2) for r in range(2)]
    try:
        gen = torch.Generator().manual_seed(0)
        for step in range(1, 6):
            rows, slot, path = shared.take(5, step, wait=lambda: None)
            want = torch.randint(-2**31, 2**31 - 1, (5, WORDS), dtype=torch.int32, generator=gen)
            rows.copy_(want)
            for reader in readers:
                assert torch.equal(reader.read(slot, path, 5), want)
                reader.consumed(step)
        readers[0].consumed(5)
        shared.take(5, 6, wait=lambda: None)  # the other slot: step 4's, read by both ranks
        with pytest.raises(RankStalled):  # step 5's slot: rank 1 never said it copied it out
            readers[1]._consumed[1] = 4
            shared.take(5, 7, wait=lambda: (_ for _ in ()).throw(RankStalled()))
    finally:
        for reader in readers:
            reader.close()
        shared.close()


def test_a_slot_grows_into_a_new_segment_and_close_unlinks_them_all():
    shared = SharedBitmasks(WORDS, num_ranks=1)
    reader = MaskReader(0, shared.consumed_path, WORDS, 1)
    paths = set()
    for step in range(NUM_SLOTS * 2):
        num_rows = 3 if step < NUM_SLOTS else MIN_ROWS + 1
        rows, slot, path = shared.take(num_rows, step, wait=lambda: None)
        rows.fill_(step)
        assert int(reader.read(slot, path, num_rows)[-1, -1]) == step
        reader.consumed(step)
        paths.add(path)
    assert len(paths) == 2 * NUM_SLOTS  # each slot's small segment replaced by a larger one
    assert sum(Path(p).exists() for p in paths) == NUM_SLOTS
    reader.close()
    shared.close()
    assert not any(Path(p).exists() for p in paths) and not Path(shared.consumed_path).exists()


def test_files_are_unlinked_once_every_rank_has_mapped_them():
    """An engine killed outright leaves nothing in /dev/shm: a segment's name goes once every
    rank has read the step that first named it (their mappings stay valid)."""
    shared = SharedBitmasks(WORDS, num_ranks=2)
    readers = [MaskReader(r, shared.consumed_path, WORDS, 2) for r in range(2)]
    shared.unlink_counters()
    assert not Path(shared.consumed_path).exists()
    rows, slot, path = shared.take(4, 1, wait=lambda: None)
    rows.fill_(7)
    shared.sent(slot, 1)
    seen = [reader.read(slot, path, 4) for reader in readers]
    readers[0].consumed(1)
    shared.take(4, 2, wait=lambda: None)  # rank 1 has not read step 1 yet: the name stays
    assert Path(path).exists()
    readers[1].consumed(1)
    shared.take(4, 3, wait=lambda: None)
    assert not Path(path).exists()
    assert all(int(rows.sum()) == 7 * 4 * WORDS for rows in seen)
    readers[0].consumed(1)  # the counters still work through the readers' mappings
    for reader in readers:
        reader.close()
    shared.close()
