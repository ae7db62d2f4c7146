"""A step as plain data: what a worker needs to run it, and nothing live. It crosses a process
boundary as it is; the engine keeps the StepPlan it came from to read the results.

    StepPlan (live requests)  --build_output-->  SchedulerOutput  --> worker(s)
         ^                                                              |
         +--------- RunnerOutput: one sampled token per row ------------+
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guided.scheduler.sampling_rows import RowSource, SamplingRows, rows_for

if TYPE_CHECKING:  # the worker imports this module, never the scheduler's live side
    from guided.scheduler.scheduler import StepPlan


@dataclass(slots=True)
class PromptLogprobSpan:
    """A prefill chunk whose prompt logprobs are asked: the step's packed tokens token_start..
    each predict the next prompt token, target_ids; num_top best tokens reported beside it."""
    token_start: int
    target_ids: list[int]
    num_top: int


@dataclass(slots=True)
class SchedulerOutput:
    input_ids: list[int]  # (T,) the step's tokens, packed; a placeholder's is 0
    positions: list[int]  # (T,)
    slot_mapping: list[int]  # (T,) KV slot of each token
    query_start_loc: list[int]  # (B + 1,) where each request's tokens start
    seq_lens: list[int]  # (B,) each request's length once the step has run
    block_tables: list[list[int]]  # (B, max_blocks) padded with 0
    logits_indices: list[int]  # (N,) the tokens whose logits are sampled
    sampling: SamplingRows  # (N,) rows
    mask_rows: list[int]  # (N,) each sampled row's row in the step's bitmask, -1: none
    num_mask_rows: int
    has_drafts: bool
    # overlapped scheduling: input_ids[placeholder_index[i]] is the token the previous step
    # samples in its row placeholder_row[i] (not yet known on the host)
    placeholder_index: list[int] = field(default_factory=list)
    placeholder_row: list[int] = field(default_factory=list)
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)  # none: no extra work

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]


@dataclass(slots=True)
class RowMap:
    """The engine's key to a step's rows: which scheduled request each sampled row is."""
    row_owner: list[int] = field(default_factory=list)  # (N,) index into plan.scheduled
    first_row: dict[str, int] = field(default_factory=dict)  # request id -> its first row
    # per prompt span (SchedulerOutput.prompt_spans): its request (index into plan.scheduled)
    # and the prompt position of its first target token
    prompt_owner: list[int] = field(default_factory=list)
    prompt_first: list[int] = field(default_factory=list)


def build_output(plan: StepPlan, *, block_size: int, placeholders: dict[int, int] | None = None
                 ) -> tuple[SchedulerOutput, RowMap]:
    """placeholders: scheduled index -> the previous step's sampled row whose token is this
    request's next input (overlapped scheduling: that token is not on the host yet).
    A constrained request's sampled rows get consecutive mask rows (item.masked)."""
    bs = block_size
    placeholders = placeholders or {}
    rows = RowMap()
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    mask_rows: list[int] = []
    sources: list[RowSource] = []
    place_index: list[int] = []
    place_row: list[int] = []
    spans: list[PromptLogprobSpan] = []
    num_mask_rows = 0
    max_blocks = max(len(item.request.block_ids) for item in plan.scheduled)
    tables: list[list[int]] = []
    # per request, not per token or row: a verify step at 256 requests has ~700 of each
    for b, item in enumerate(plan.scheduled):
        req = item.request
        start = req.num_computed_tokens + req.num_inflight_tokens
        num_drafts = item.num_draft_tokens
        n = item.num_new_tokens + num_drafts
        table = req.block_ids
        tables.append(table + [0] * (max_blocks - len(table)))
        pending_row = placeholders.get(b)
        if pending_row is not None:  # its one new token is the in-flight sample,
            place_index.append(len(ids))  # gathered on the device at launch
            place_row.append(pending_row)
            ids.append(0)
            ids.extend(item.draft_token_ids[:num_drafts])
        elif start + n <= len(req.prompt_token_ids):  # a prefill chunk: a slice, not n calls
            ids.extend(req.prompt_token_ids[start:start + n])
        else:
            known = req.num_tokens
            ids.extend(req.token_at(pos) if pos < known
                       else item.draft_token_ids[pos - known] for pos in range(start, start + n))
        positions.extend(range(start, start + n))
        if n == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:  # one range per block the tokens fill
            pos, end = start, start + n
            while pos < end:
                block = pos // bs
                block_end = min(end, (block + 1) * bs)
                offset = (table[block] - block) * bs  # slot = table[block] * bs + pos % bs
                slots.extend(range(offset + pos, offset + block_end))
                pos = block_end
        query_start.append(len(ids))
        seq_lens.append(start + n)
        # the last prompt position's logits sample; the attribute first: a decode step's cost
        if req.prompt_logprobs is not None and req.needs_prompt_logprobs \
                and start < len(req.prompt_token_ids) - 1:
            end = min(start + n, len(req.prompt_token_ids) - 1)
            spans.append(PromptLogprobSpan(len(ids) - n, req.prompt_token_ids[start + 1:end + 1],
                                           req.params.prompt_logprobs))
            rows.prompt_owner.append(b)
            rows.prompt_first.append(start + 1)
        if not item.sample:
            continue
        count = 1 + num_drafts
        rows.first_row[req.request_id] = len(logits_indices)
        logits_indices.extend(range(len(ids) - count, len(ids)))
        rows.row_owner.extend([b] * count)
        if item.masked:
            mask_rows.extend(range(num_mask_rows, num_mask_rows + count))
            num_mask_rows += count
        else:
            mask_rows.extend([-1] * count)
        p = req.params
        # which output token its first row samples (in-flight ones come before it)
        sources.append(RowSource(
            p, count, req.seed, len(req.output_token_ids) + req.num_inflight_samples,
            req.prompt_token_ids,
            [req.output_token_ids + item.draft_token_ids[:j] for j in range(count)]
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
            else None,
            stop_ids=(*req.eos_token_ids, *(p.stop_token_ids or ())) if p.min_tokens else ()))
    out = SchedulerOutput(
        input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=query_start,
        seq_lens=seq_lens, block_tables=tables, logits_indices=logits_indices,
        sampling=rows_for(sources), mask_rows=mask_rows, num_mask_rows=num_mask_rows,
        has_drafts=any(item.num_draft_tokens for item in plan.scheduled),
        placeholder_index=place_index, placeholder_row=place_row, prompt_spans=spans)
    return out, rows
