"""schedule() -> StepPlan: whom to run this step, how many tokens each, their blocks.

One view covers prefill, chunked prefill, prefix hits, decode and jump-forward drafts: each
request catches up from num_computed_tokens to its known tokens (plus drafts), within the step's
token budget.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from guided.config import EngineConfig
from guided.scheduler import policy
from guided.scheduler.block_manager import BlockManager
from guided.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # committed tokens computed this step, from num_computed_tokens on
    num_draft_tokens: int  # jump-forward drafts fed after them (only when sampling)
    sample: bool  # the chunk reaches the last known token: sample 1 + num_draft_tokens tokens
    draft_token_ids: list[int] = field(default_factory=list)  # the drafts fed, as scheduled
    num_forced_drafts: int = 0  # leading drafts that are forced text (the rest: lookup)
    # overlapped scheduling: its one new token is its previous step's last sample, in flight
    placeholder: bool = False
    anchor: int | None = None  # the drafts assume that sample is this token
    drafts_void: bool = False  # it was not: only the first sampled row stands
    voided: bool = False  # the previous step rejected a draft this entry assumed: all dropped

    @property
    def masked(self) -> bool:
        """Its sampled rows get grammar mask rows."""
        return self.request.matcher is not None and self.sample

    @property
    def num_live_drafts(self) -> int:
        return 0 if self.drafts_void else self.num_draft_tokens


@dataclass(slots=True)
class StepPlan:
    """A step over live requests (the worker gets its plain-data form, scheduler/output.py)."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, admission order
        self.compiling: list[Request] = []  # WAITING_FOR_GRAMMAR
        self.running: list[Request] = []
        self._arrival = itertools.count()
        self.arrival_index: dict[str, int] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queues -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.arrival_index[request.request_id] = next(self._arrival)
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.compiling.append(request)
        else:
            self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.compiling) + len(self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of every queue and free its blocks (finish or abort)."""
        for queue in (self.running, self.compiling, self.waiting):
            if request in queue:
                queue.remove(request)
        self.free_blocks(request)
        self.arrival_index.pop(request.request_id, None)

    def free_blocks(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0

    # -- schedule -----------------------------------------------------------------------------
    def take_compiled(self) -> list[Request]:
        """The compiling requests whose compile has ended (ready or failed), taken out of the
        compiling queue."""
        done, still = [], []
        for request in self.compiling:
            (done if request.grammar_future.done() else still).append(request)
        self.compiling = still
        return done

    def admit_compiled(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        out = StepPlan()
        budget = self.config.max_num_batched_tokens

        # 1. running requests, oldest first; preempt the newest when blocks run out
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted for an older one
                continue
            if request.num_inflight_samples and not self._joins_in_flight(request):
                continue
            item = self._fit(request, budget, out)
            if item is not None and item.num_new_tokens + item.num_draft_tokens:
                out.scheduled.append(item)
                budget -= item.num_new_tokens + item.num_draft_tokens

        # 2. admit waiting requests while the budget, the seat count and the cache allow
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.in_flight:  # preempted while a step of it ran: wait for its tokens
                break
            if not self._admit(request):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            item = self._fit(request, budget, out)
            if item is None:
                break
            out.scheduled.append(item)
            budget -= item.num_new_tokens + item.num_draft_tokens
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
        return out

    def _admit(self, request: Request) -> bool:
        bs = self.blocks.block_size
        num_tokens = request.num_tokens
        # the last token is always recomputed: its logits are needed; prompt logprobs need
        # every prompt position's hidden state, which a cached block does not keep: no lookup
        # (vLLM's rule; nor does it count as one)
        looks_up = not request.needs_prompt_logprobs
        hits = self.blocks.find_cached_prefix(request.all_token_ids, num_tokens - 1) \
            if looks_up else []
        horizon = policy.ADMISSION_LOOKAHEAD_TOKENS
        # cached-but-unreferenced hits leave the free queue when shared
        num_free_hits = sum(1 for b in hits if self.blocks.blocks[b].ref_count == 0)
        ok = policy.can_admit(
            prompt_blocks_needed=self.blocks.blocks_needed(num_tokens) - len(hits),
            num_free_blocks=self.blocks.num_free_blocks - num_free_hits,
            num_total_blocks=self.blocks.num_blocks,
            running_current=[r.num_tokens for r in self.running],
            running_remaining=[policy.expected_remaining(r.max_tokens, len(r.output_token_ids),
                                                         cap=horizon) for r in self.running],
            new_current=num_tokens,
            new_remaining=policy.expected_remaining(request.max_tokens,
                                                    len(request.output_token_ids), cap=horizon),
            block_size=bs,
            watermark_blocks=max(1, self.blocks.num_blocks // 100),
        )
        if not ok:
            return False
        self.blocks.share(hits)
        request.block_ids = list(hits)
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = len(hits) * bs
        self.prefix_queries += num_tokens if looks_up else 0
        self.prefix_hits += len(hits) * bs
        request.metrics.prefix_cache_hit_tokens += len(hits) * bs
        return True

    def _joins_in_flight(self, request: Request) -> bool:
        """Whether a request whose last step is in flight joins this one (overlapped
        scheduling); if it waits, its drafts (anchored on that step's sample) are dropped."""
        p = request.params
        joins = policy.joins_while_in_flight(
            needs_history=bool(p.presence_penalty or p.frequency_penalty
                               or p.repetition_penalty != 1.0),
            tokens_left=min(request.max_tokens - len(request.output_token_ids),
                            self.max_model_len - request.num_tokens)
            - request.num_inflight_samples)
        if not joins:
            request.draft_token_ids, request.draft_anchor = [], None
        return joins

    def _fit(self, request: Request, budget: int, out: StepPlan) -> ScheduledRequest | None:
        """Decide this step's tokens for a running request and secure their blocks, preempting
        the newest running requests if needed. None: the request itself was preempted."""
        computed = request.num_computed_tokens + request.num_inflight_tokens
        pending = request.num_tokens + request.num_inflight_samples - computed
        num_new = min(pending, budget)
        sample = num_new == pending
        placeholder = request.num_inflight_samples > 0
        if placeholder != (request.draft_anchor is not None):
            # drafts fit only the state they were proposed from: after the in-flight sample
            # (anchored) when one is in flight, after the committed tokens otherwise
            request.draft_token_ids, request.draft_anchor = [], None
        num_draft = min(len(request.draft_token_ids), budget - num_new) if sample else 0
        if num_draft < len(request.draft_token_ids):
            request.draft_token_ids = request.draft_token_ids[:num_draft]
        needed = self.blocks.blocks_needed(computed + num_new + num_draft)
        extra = needed - len(request.block_ids)
        while extra > self.blocks.num_free_blocks:
            victim = self._preempt_newest(out)
            if victim is request:
                return None
        if extra > 0:
            request.block_ids += self.blocks.allocate(extra)
        return ScheduledRequest(request, num_new, num_draft, sample,
                                draft_token_ids=list(request.draft_token_ids[:num_draft]),
                                num_forced_drafts=min(request.num_forced_drafts, num_draft),
                                placeholder=placeholder,
                                anchor=request.draft_anchor if num_draft else None)

    def _preempt_newest(self, out: StepPlan) -> Request:
        # the latest arrival: it has the least work to redo, the earliest keep their latency
        victim = max(self.running, key=lambda r: self.arrival_index[r.request_id])
        self.running.remove(victim)
        self.free_blocks(victim)
        victim.num_computed_tokens = 0
        victim.draft_token_ids, victim.draft_anchor = [], None
        victim.status = RequestStatus.PREEMPTED
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        for item in list(out.scheduled):  # a victim scheduled earlier this step is unscheduled
            if item.request is victim:
                out.scheduled.remove(item)
        return victim

    # -- steps in flight (overlapped scheduling) ----------------------------------------------
    # At most one step of a request is unseen when the next is scheduled. That next step
    # assumes the unseen one's drafts are all accepted (it starts after them, on their last
    # sample); settle_in_flight corrects the assumption once the tokens are seen.
    def launched(self, sched: StepPlan) -> None:
        for item in sched.scheduled:
            request = item.request
            request.num_inflight_tokens += item.num_new_tokens + item.num_draft_tokens
            if item.sample:
                request.num_inflight_samples += 1 + item.num_draft_tokens
                request.inflight = item

    def landed(self, sched: StepPlan) -> None:
        for item in sched.scheduled:
            if not item.voided:
                self._uncount(item)

    def _uncount(self, item: ScheduledRequest) -> None:
        """Take what the entry still adds (its live drafts) off its request's in-flight counts."""
        request = item.request
        request.num_inflight_tokens -= item.num_new_tokens + item.num_live_drafts
        if item.sample:
            request.num_inflight_samples -= 1 + item.num_live_drafts
            if request.inflight is item:
                request.inflight = None

    def settle_in_flight(self, request: Request, *, kept_all_drafts: bool) -> None:
        """The request's tokens of step t were appended; its entry in step t+1 (in flight)
        assumed them. A rejected draft voids that entry: its rows are dropped and the request is
        scheduled again from its committed tokens (later steps rewrite the entry's K/V slots).
        If its drafts were anchored on a token that t did not sample, only its first row stands."""
        item = request.inflight
        if item is None:
            return
        if not kept_all_drafts:
            self._uncount(item)
            item.voided = True
        elif item.anchor is not None and not item.drafts_void \
                and request.output_token_ids[-1] != item.anchor:
            request.num_inflight_tokens -= item.num_draft_tokens
            request.num_inflight_samples -= item.num_draft_tokens
            item.drafts_void = True

    def forget_in_flight(self) -> None:
        """The steps in flight are lost (a failed step): back to the committed tokens."""
        for request in [*self.running, *self.waiting]:
            request.num_inflight_tokens = request.num_inflight_samples = 0
            request.inflight = None
            request.draft_token_ids, request.draft_anchor = [], None

    # -- after the step -----------------------------------------------------------------------
    def commit_computed(self, request: Request, num_computed: int) -> None:
        """Advance the request's computed tokens and register newly full blocks for reuse."""
        request.num_computed_tokens = num_computed
        num_full = min(num_computed, request.num_tokens) // self.blocks.block_size
        if num_full > request.num_cached_blocks:
            request.num_cached_blocks = self.blocks.register_full_blocks(
                request.block_ids, request.all_token_ids, request.num_cached_blocks, num_full)

    def trim_blocks(self, request: Request) -> None:
        """Free blocks past what the request's tokens need (rejected drafts' slots)."""
        keep = self.blocks.blocks_needed(request.num_tokens + request.num_inflight_samples + 1)
        if len(request.block_ids) > keep:
            self.blocks.free(request.block_ids[keep:])
            del request.block_ids[keep:]
