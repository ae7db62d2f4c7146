"""Grammar masks filled ahead of their step.

Right after a step's update the grammar state of every running constrained request is final
for the next step (its committed tokens and its drafts), so their mask rows are filled then, on
the mask thread, while the host finishes this step (outputs, text) and schedules and prepares
the next one. The next step copies the rows it needs and fills only what was not ahead
(requests admitted since, drafts that changed). Matchers change only in the update, after the
next step's masks are taken, so the rows cannot go stale in between.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from guided.masks.bitmask_fill import fill_draft_rows
from guided.fsm.matcher import Matcher


class MaskPrefetch:
    def __init__(self, submit: Callable[[Callable[[], None]], Future], mask_words: int, *,
                 num_threads: int):
        self._submit = submit  # runs a job on the mask thread, in order with the step's fill
        self._mask_words = mask_words
        self._num_threads = num_threads
        self._job: Future | None = None
        self._buffer: torch.Tensor | None = None
        self._rows: dict[str, tuple[Matcher, tuple[int, ...], int]] = {}  # id -> (.., first row)

    def start(self, requests: list) -> None:
        """Fill ahead the rows of these requests (each: request_id, matcher, draft_token_ids)."""
        entries, rows, first = [], {}, 0
        for request in requests:
            drafts = list(request.draft_token_ids)
            entries.append((request.matcher, drafts, first))
            rows[request.request_id] = (request.matcher, tuple(drafts), first)
            first += len(drafts) + 1
        if not entries:
            self.clear()
            return
        with torch.inference_mode(False):  # written by the mask thread
            buffer = torch.empty(first, self._mask_words, dtype=torch.int32)
        self._buffer, self._rows = buffer, rows
        self._job = self._submit(lambda: fill_draft_rows(entries, buffer,
                                                         num_threads=self._num_threads))

    def take(self, request_id: str, matcher: Matcher, drafts: list[int]) -> int | None:
        """The first prefetched row of this request if its rows cover these drafts (call on
        the mask thread, after start's job ran), else None."""
        if self._job is None:
            return None
        self._job.result()  # done: jobs run in order on one thread
        entry = self._rows.get(request_id)
        if entry is None or entry[0] is not matcher or tuple(drafts) != entry[1][:len(drafts)]:
            return None
        return entry[2]

    @property
    def buffer(self) -> torch.Tensor | None:
        return self._buffer

    def clear(self) -> None:
        """Drops the rows filled ahead, once their job is done: the matchers may move on."""
        if self._job is not None:
            self._job.result()
        self._job, self._buffer, self._rows = None, None, {}
