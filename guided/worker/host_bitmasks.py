"""Pinned host buffers for the steps' grammar mask rows, reused from step to step.

A fresh pinned tensor per step is a page-locking allocation on the step loop's critical path
(it showed as ~2.5 ms a step under a profiler on an H200 at concurrency 64). A few buffers
taken in turn, grown to the most rows seen, cost nothing once warm; a buffer is handed out
again only after its last copy to the device has run (an event per buffer).

shared: the buffers are files mapped in memory (under /dev/shm where it has room), so mask
shard processes (guided/fsm/mask_shards.py) write their rows straight into them; on a GPU
they are page-locked in place (cudaHostRegister)."""
from __future__ import annotations

import mmap
import os
import tempfile
import weakref

import torch

MIN_ROWS = 64


class SharedSegment:
    """A file mapped in memory: another process maps it by path."""

    def __init__(self, nbytes: int, *, pin: bool):
        self.nbytes = nbytes
        self.path = self.pinned = None
        for folder in ("/dev/shm", tempfile.gettempdir()):
            if not os.path.isdir(folder):
                continue
            fd, path = tempfile.mkstemp(prefix="guided-mask-", dir=folder)
            try:
                # reserved now: a tmpfs past its size would fail a later write with SIGBUS
                os.posix_fallocate(fd, 0, nbytes)
                self.map = mmap.mmap(fd, nbytes)
                self.path = path
                break
            except OSError:
                os.unlink(path)
            finally:
                os.close(fd)
        if self.path is None:
            raise OSError(f"no room for a {nbytes}-byte shared mask buffer")
        self.tensor = torch.frombuffer(self.map, dtype=torch.int32)
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0  # unpinned, copies are synchronous (still correct)
        self._finalizer = weakref.finalize(self, _release, self.path, self.tensor.data_ptr(),
                                           bool(self.pinned))

    def release(self) -> None:
        """Unpin and remove the file (the mapping lives on while tensors view it)."""
        self._finalizer()


def _release(path: str, ptr: int, pinned: bool) -> None:
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    try:
        os.unlink(path)
    except OSError:
        pass


class HostBitmasks:
    def __init__(self, words: int, device: torch.device, *, num_buffers: int = 2,
                 shared: bool = False):
        self.words = words
        self.pinned = device.type == "cuda"
        self.shared = shared
        self._device = device
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._segments: list[SharedSegment | None] = [None] * num_buffers
        self._copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def take(self, num_rows: int) -> torch.Tensor:
        """An int32 (num_rows, words) host tensor to fill; its old contents are garbage."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
            self._copied[slot] = None
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape[0] < num_rows:
            capacity = max(MIN_ROWS, 1 << (num_rows - 1).bit_length())
            # a normal tensor: the filler thread is outside inference mode (it is thread-local)
            with torch.inference_mode(False):
                if self.shared:
                    if self._segments[slot] is not None:
                        self._segments[slot].release()
                    segment = self._segments[slot] = SharedSegment(
                        capacity * self.words * 4, pin=self.pinned)
                    buffer = segment.tensor.view(capacity, self.words)
                else:
                    buffer = torch.empty(capacity, self.words, dtype=torch.int32,
                                         pin_memory=self.pinned)
            self._buffers[slot] = buffer
        return buffer[:num_rows]

    def segment_of(self, rows: torch.Tensor) -> tuple[str, int] | None:
        """(path, capacity in rows) of the shared buffer rows were taken from, else None."""
        slot = self._slot_of(rows)
        segment = None if slot is None else self._segments[slot]
        return None if segment is None else (segment.path, self._buffers[slot].shape[0])

    def _slot_of(self, rows: torch.Tensor) -> int | None:
        storage = rows.untyped_storage().data_ptr()
        for slot, buffer in enumerate(self._buffers):
            if buffer is not None and buffer.untyped_storage().data_ptr() == storage:
                return slot
        return None

    def to_device(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Queue rows' copy to the device (into out where given: one copy, not two); the buffer
        they came from waits for it."""
        on_device = (rows.to(self._device, non_blocking=self.pinned) if out is None
                     else out.copy_(rows, non_blocking=self.pinned))
        if not self.pinned:
            return on_device
        event = torch.cuda.Event()
        event.record()
        slot = self._slot_of(rows)
        if slot is not None:
            self._copied[slot] = event
        return on_device

    def release(self) -> None:
        for segment in self._segments:
            if segment is not None:
                segment.release()
