"""A step's integer inputs to the device in one copy: packed into a pinned host buffer and
viewed out of the copy on the device. Each array copied on its own from pageable memory cost a
staged copy and a launch apiece, nine a step."""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 8  # bytes: every array starts where an int64 view of it may
NUM_BUFFERS = 2  # steps whose copies may be queued at once (overlapped scheduling's depth + 1)
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class StepUpload:
    """upload(arrays) -> their device tensors, same shapes and dtypes. Buffers are taken in
    turn, each refilled once its last copy has run."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * NUM_BUFFERS
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_BUFFERS
        self._next = 0

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = byte_offsets(arrays)
        slot = self._next
        self._next = (slot + 1) % NUM_BUFFERS
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < total:
            buffer = self._buffers[slot] = torch.empty(
                max(4096, 1 << (total - 1).bit_length()), dtype=torch.uint8, pin_memory=True)
        pack(arrays, offsets, buffer)
        on_device = buffer[:total].to(self.device, non_blocking=True)
        event = self._copied[slot] = torch.cuda.Event()
        event.record()
        return unpack(on_device, arrays, offsets)


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
