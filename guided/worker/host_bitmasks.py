"""Pinned host buffers for the steps' grammar mask rows, reused from step to step.

A fresh pinned tensor per step is a page-locking allocation on the step loop's critical path
(it showed as ~2.5 ms a step under a profiler on an H200 at concurrency 64). A few buffers
taken in turn, grown to the most rows seen, cost nothing once warm; a buffer is handed out
again only after its last copy to the device has run (an event per buffer).
"""
from __future__ import annotations

import torch

MIN_ROWS = 64


class HostBitmasks:
    def __init__(self, words: int, device: torch.device, *, num_buffers: int = 2):
        self.words = words
        self.pinned = device.type == "cuda"
        self._device = device
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
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
                buffer = torch.empty(capacity, self.words, dtype=torch.int32,
                                     pin_memory=self.pinned)
            self._buffers[slot] = buffer
        return buffer[:num_rows]

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
