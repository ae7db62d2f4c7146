"""A step's bitmask rows in shared memory: the engine fills them once, straight into a segment
every rank maps, and the step's Sample only names it (MaskSlot).

NUM_SLOTS segments are taken in turn (step t fills one while the ranks may still read t-1's), each
grown to the most rows seen; a slot is refilled only once every rank has copied the last step's
rows out (a counter per rank in a segment of its own). Segments are files in /dev/shm, unlinked
as soon as every rank has mapped them, so that an engine killed outright leaves nothing behind."""
from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

NUM_SLOTS = 2
MIN_ROWS = 64
WAIT_POLL_S = 0.0005  # a rank still reading a slot: seen only after a failed step (forget)
UNSENT = float("inf")


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class Segment:
    def __init__(self, path: Path, size: int, *, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self.size = size

    def array(self, dtype, shape: tuple[int, ...]) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self.map.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class SharedBitmasks:
    def __init__(self, words: int, num_ranks: int):
        self.words = words
        self.prefix = f"guided-{os.getpid()}-{id(self):x}"
        self._generation = 0
        counters = _shm_dir() / f"{self.prefix}-consumed"
        self.consumed_segment = Segment(counters, 8 * num_ranks, create=True)
        # each rank's last step whose mask rows it has copied out
        self._consumed = self.consumed_segment.array(np.int64, (num_ranks,))
        self._consumed[:] = -1
        self.consumed_path = str(counters)
        self._segments: list[Segment | None] = [None] * NUM_SLOTS
        self._rows: list[int] = [0] * NUM_SLOTS
        self._last_step: list[int] = [-1] * NUM_SLOTS
        # a new segment's first step sent to the ranks (UNSENT until then): once every rank has
        # copied that step out, every rank has mapped the file and its name can go
        self._unlink_after: list[float | None] = [None] * NUM_SLOTS
        self._next = 0

    def take(self, num_rows: int, step: int, *, wait: Callable[[], None]) -> tuple[
            torch.Tensor, int, str]:
        """(an int32 (num_rows, words) view to fill, its slot, its path). wait: called between
        polls while a rank still reads the slot (raises if a rank has died)."""
        done = int(self._consumed.min())
        for i, after in enumerate(self._unlink_after):
            if after is not None and done >= after:  # every rank has segment i mapped
                self._segments[i].unlink()
                self._unlink_after[i] = None
        slot = self._next
        self._next = (slot + 1) % NUM_SLOTS
        while int(self._consumed.min()) < self._last_step[slot]:
            wait()
            time.sleep(WAIT_POLL_S)
        self._last_step[slot] = step
        segment = self._segments[slot]
        if segment is None or self._rows[slot] < num_rows:
            capacity = max(MIN_ROWS, 1 << (num_rows - 1).bit_length())
            if segment is not None:  # the ranks keep their mapping until they see the new one
                segment.close()
                segment.unlink()
            self._generation += 1
            path = _shm_dir() / f"{self.prefix}-{slot}-{self._generation}"
            segment = self._segments[slot] = Segment(path, capacity * self.words * 4, create=True)
            self._rows[slot] = capacity
            self._unlink_after[slot] = UNSENT
        rows = segment.array(np.int32, (self._rows[slot], self.words))[:num_rows]
        return torch.from_numpy(rows), slot, str(segment.path)

    def sent(self, slot: int, step: int) -> None:
        if self._unlink_after[slot] == UNSENT:
            self._unlink_after[slot] = step

    def unlink_counters(self) -> None:
        """Every rank maps the counters before it says Ready."""
        self.consumed_segment.unlink()

    def close(self) -> None:
        for segment in [*self._segments, self.consumed_segment]:
            if segment is not None:
                segment.close()
                segment.unlink()
        self._segments = [None] * NUM_SLOTS


class MaskReader:
    """A rank's side: one mapped segment per slot (a grown slot's replaces the old one)."""

    def __init__(self, rank: int, consumed_path: str, words: int, num_ranks: int):
        self.rank = rank
        self.words = words
        self._consumed_segment = Segment(Path(consumed_path), 8 * num_ranks, create=False)
        self._consumed = self._consumed_segment.array(np.int64, (num_ranks,))
        self._mapped: dict[int, Segment] = {}

    def read(self, slot: int, path: str, num_rows: int) -> torch.Tensor:
        """Valid until consumed() is called."""
        segment = self._mapped.get(slot)
        if segment is None or str(segment.path) != path:
            if segment is not None:
                segment.close()
            size = os.stat(path).st_size
            segment = self._mapped[slot] = Segment(Path(path), size, create=False)
        rows = segment.array(np.int32, (segment.size // (4 * self.words), self.words))
        return torch.from_numpy(rows[:num_rows])

    def consumed(self, step: int) -> None:
        self._consumed[self.rank] = step

    def close(self) -> None:
        for segment in [*self._mapped.values(), self._consumed_segment]:
            segment.close()
        self._mapped = {}
