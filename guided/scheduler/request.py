"""A request's life in the engine: its tokens, its KV blocks, its matcher, its status."""
from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guided.outputs import FinishReason, RequestMetrics, TokenLogprob
from guided.params import SamplingParams

if TYPE_CHECKING:
    from guided.scheduler.scheduler import ScheduledRequest


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # constraint compiling; others keep decoding
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputed from its tokens when readmitted
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's sampling seed (given, or drawn by the engine)
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # the effective output limit (params and context length)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # jump-forward: forced tokens proposed for the next step, verified there like draft tokens
    draft_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (committed tokens only)
    # overlapped scheduling: what the launched step not yet seen by the host adds, counting
    # its drafts as accepted (if one is rejected, the step after it is voided: see Scheduler)
    num_inflight_tokens: int = 0  # tokens it computes (not yet in num_computed_tokens)
    num_inflight_samples: int = 0  # tokens it samples (the next inputs, unknown)
    inflight: ScheduledRequest | None = None  # that step's entry for this request (sampling)
    # forced-text drafts proposed while a step is in flight follow its last sample, assumed to
    # be this token (the forced text's first); None: the drafts follow the committed tokens
    draft_anchor: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_forced_drafts: int = 0  # leading drafts that are forced text (the rest: lookup)
    # what the draft proposer learnt of this request (engine/drafts.py DraftState)
    draft_state: Any = None
    grammar_future: Future | None = None  # the compile of its constraint
    # the grammar's matcher (fsm/matcher.py), at the committed tokens: masks are filled and
    # drafts walked from it; the scheduler never looks inside
    matcher: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_type: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled chunk by chunk
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # incremental detokenization state
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        if index < p:
            return self.prompt_token_ids[index]
        index -= p
        if index < len(self.output_token_ids):
            return self.output_token_ids[index]
        return self.draft_token_ids[index - len(self.output_token_ids)]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed (a preempted request's stay computed)."""
        held = self.prompt_logprobs
        return held is not None and len(held) < len(self.prompt_token_ids)

    @property
    def in_flight(self) -> bool:
        return bool(self.num_inflight_tokens or self.num_inflight_samples)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
