"""A step's host data on its way to the device: host buffers taken in turn (PinnedRing), and a
step's integer inputs in one copy (StepUpload), packed into one pinned buffer and viewed out of
the copy on the device, where nine copies from pageable memory would stage each one."""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 8  # bytes: every array starts where an int64 view of it may
NUM_BUFFERS = 2  # steps whose copies may be queued at once (overlapped scheduling's depth + 1)
MIN_UPLOAD_BYTES = 4096
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class PinnedRing:
    """Host buffers (pinned for a GPU) taken in turn, each handed out again only once the copy
    queued from it has run: a fresh pinned tensor per step would page-lock memory on the step's
    critical path. take(rows) -> rows [x width] of the next buffer (old contents: garbage);
    to_device(rows of the buffer taken last) queues their copy."""

    def __init__(self, device: torch.device, dtype: torch.dtype, width: int | None = None, *,
                 min_rows: int):
        self.device, self.dtype, self.width, self.min_rows = device, dtype, width, min_rows
        self._buffers: list[torch.Tensor | None] = [None] * NUM_BUFFERS
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_BUFFERS
        self._next = self._taken = 0

    def take(self, rows: int) -> torch.Tensor:
        slot = self._taken = self._next
        self._next = (slot + 1) % NUM_BUFFERS
        copied, self._copied[slot] = self._copied[slot], None
        if copied is not None:
            copied.synchronize()
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape[0] < rows:
            capacity = max(self.min_rows, 1 << (rows - 1).bit_length())
            shape = (capacity,) if self.width is None else (capacity, self.width)
            # a normal tensor: a filler thread is outside inference mode (it is thread-local)
            with torch.inference_mode(False):
                buffer = self._buffers[slot] = torch.empty(
                    shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        return buffer[:rows]

    def to_device(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return rows
        on_device = rows.to(self.device, non_blocking=True)
        event = self._copied[self._taken] = torch.cuda.Event()
        event.record()
        return on_device


class StepUpload:
    """upload(arrays) -> their device tensors, same shapes and dtypes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ring = PinnedRing(device, torch.uint8, min_rows=MIN_UPLOAD_BYTES)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = byte_offsets(arrays)
        buffer = self._ring.take(total)
        pack(arrays, offsets, buffer)
        return unpack(self._ring.to_device(buffer), arrays, offsets)


def byte_offsets(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """Where each array starts in the packed buffer, and the bytes they take in all."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, total


def pack(arrays: list[np.ndarray], offsets: list[int], buffer: torch.Tensor) -> None:
    """Write the arrays' bytes into a host uint8 buffer at their offsets."""
    host = buffer.numpy()
    for a, offset in zip(arrays, offsets):
        host[offset:offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def unpack(packed: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]
           ) -> list[torch.Tensor]:
    """Views of the packed uint8 tensor (on any device) with the arrays' dtypes and shapes."""
    return [packed[offset:offset + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]
