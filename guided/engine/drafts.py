"""A constrained request's next drafts and what its last ones taught: forced text (then prompt
lookup) from jump_forward.py, anchored on the in-flight sample under overlapped scheduling, and
the cool-downs that stop proposing guesses that keep missing."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from guided.engine.ngram import NgramIndex
from guided.fsm.jump_forward import CachedEncoder, DraftAsk, make_drafts
from guided.scheduler import policy
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest
from guided.worker.step_times import StepTimes

log = logging.getLogger(__name__)

MAX_JUMP_FORWARD_TOKENS = 32  # drafts per request and step (forced text, then lookup)
LOOKUP_DRAFT_TOKENS = 4  # prompt-lookup guesses past the forced text, verified like it
# lookup guesses only up to this batch (as vLLM turns speculation off by batch size): past the
# memory-bound knee a guess costs more verify compute than it saves (RESULTS: +9% at 256 without)
LOOKUP_MAX_BATCH = 128
# anchored drafts (on the in-flight sample) only while they gain this many tokens each on
# average: a random-weights model gains ~0 and pays the verify rows
MIN_ANCHOR_GAIN = 0.5


@dataclass(slots=True)
class DraftState:
    """What the proposer keeps of one request: its tokens indexed for prompt lookup, and the
    cool-downs after drafts that missed."""
    ngram: NgramIndex | None = None
    lookup_misses: int = 0  # lookup drafts rejected in a row
    lookup_skip: int = 0  # proposals left without lookup (cool-down after misses)
    # overlapped scheduling: a first draft rejected voids the step after it (see Scheduler)
    anchored_misses: int = 0  # such rejections in a row
    anchored_skip: int = 0  # proposals left without drafts (cool-down)


def state_of(request: Request) -> DraftState:
    if request.draft_state is None:
        request.draft_state = DraftState()
    return request.draft_state


@dataclass(slots=True)
class AnchorPayoff:
    """A running mean of what anchored proposals gained against an unanchored step, over all
    requests (writing the grammar's forced text in the drafted tokens is the model's trait). A
    hit gains its kept drafts, less the voided step after it if one was rejected; a miss, 0.

    Below the bar, one step in probe_every (at random) still anchors about probes_per_step of
    its proposals, to see again: few probes in few steps, since every draft makes its step a
    verify step whose padded rows a large model pays for in every layer."""
    min_gain: float = MIN_ANCHOR_GAIN
    mean_gain: float = 1.0  # drafts are tried first
    weight: float = 1 / 64
    probe_every: int = 8
    probes_per_step: int = 8
    num_asked: int = 0  # proposals asked about while below the bar
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    probing: bool = False  # this step probes

    def note(self, gain: int) -> None:
        self.mean_gain += self.weight * (gain - self.mean_gain)

    def start_step(self) -> None:
        self.probing = self.rng.random() * self.probe_every < 1

    def allows(self, num_running: int = 1) -> bool:
        if self.mean_gain >= self.min_gain:
            return True
        self.num_asked += 1
        return self.probing and self.rng.random() * num_running < self.probes_per_step


class DraftProposer:
    def __init__(self, encoder: CachedEncoder, token_bytes: list[bytes], *, max_model_len: int,
                 max_draft_tokens: int | None, special_ids: frozenset[int], overlap: bool,
                 payoff: AnchorPayoff | None = None):
        self.payoff = payoff or AnchorPayoff()
        self.encoder = encoder
        self.token_bytes = token_bytes
        self.max_model_len = max_model_len
        self.max_draft_tokens = min(max_draft_tokens or MAX_JUMP_FORWARD_TOKENS,
                                    MAX_JUMP_FORWARD_TOKENS)
        self.special_ids = special_ids
        self.overlap = overlap  # the next step assumes the drafts in flight accepted

    def propose(self, requests: list[Request], *, num_running: int, times: StepTimes) -> None:
        """Sets the requests' next drafts (draft_token_ids, draft_anchor, num_forced_drafts)."""
        with times.phase("jump_forward"):
            self.payoff.start_step()
            for request in requests:
                if request.is_finished:
                    continue
                ask = self.plan(request, num_running=num_running)
                if ask is not None:
                    self.walk(request, ask)

    def plan(self, request: Request, *, num_running: int = 1) -> DraftAsk | None:
        """Clears the request's drafts and says what the walk may look at (None: nothing to
        propose); counts its cool-downs down."""
        inflight = request.inflight
        room = min(request.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens) - request.num_inflight_samples - 1
        room = min(room, self.max_draft_tokens)
        request.draft_token_ids, request.draft_anchor, request.num_forced_drafts = [], None, 0
        if room <= 0:
            return None
        state = state_of(request)
        if inflight is not None and not (self.overlap and state.anchored_skip) \
                and not self.payoff.allows(num_running):
            return None  # anchored drafts do not pay now
        lookup_tokens = (LOOKUP_DRAFT_TOKENS if num_running <= LOOKUP_MAX_BATCH
                         and self._lookup_ready(request) else 0)
        if self.overlap and state.anchored_skip:
            state.anchored_skip -= 1
            return None
        assumed = (None if inflight is None
                   else tuple(inflight.draft_token_ids[:inflight.num_live_drafts]))
        return DraftAsk(room, lookup_tokens, assumed)

    def walk(self, request: Request, ask: DraftAsk) -> None:
        try:
            lookup = None
            if ask.lookup_tokens:
                state = state_of(request)
                if state.ngram is None:
                    state.ngram = NgramIndex(self.special_ids)
                state.ngram.sync(request.prompt_token_ids, request.output_token_ids)
                lookup = state.ngram
            result = make_drafts(self.encoder, self.token_bytes, request.matcher,
                                 request.output_token_ids, ask, lookup)
        except Exception:
            log.exception("jump-forward proposal failed for %s", request.request_id)
            result = None, [], 0
        request.draft_anchor, request.draft_token_ids, request.num_forced_drafts = result

    def _lookup_ready(self, request: Request) -> bool:
        state = state_of(request)
        if state.lookup_skip:
            state.lookup_skip -= 1
            return False
        return True


def note_anchor_missed(request: Request, item: ScheduledRequest,
                       payoff: AnchorPayoff | None = None) -> None:
    """The entry's drafts were anchored on a token its previous step did not sample."""
    if payoff is not None:
        payoff.note(0)
    if item.num_draft_tokens > item.num_forced_drafts:  # the anchor was a lookup guess
        _lookup_missed(request)


def note_verified(request: Request, item: ScheduledRequest, drafts: list[int],
                  num_matched: int, payoff: AnchorPayoff | None = None) -> None:
    """After the entry's drafts were verified (num_matched kept)."""
    if payoff is not None and item.anchor is not None and not item.drafts_void:
        voids_next = num_matched < len(drafts) and request.inflight is not None
        payoff.note(num_matched - voids_next)
    if len(drafts) > item.num_forced_drafts:  # lookup tokens were drafted
        if num_matched > item.num_forced_drafts:
            state_of(request).lookup_misses = 0
        elif num_matched == item.num_forced_drafts:  # the first guess was wrong
            _lookup_missed(request)
    if drafts and request.inflight is not None and not request.is_finished:
        # the next step assumed them all: a first draft missed costs it (one token, two steps)
        state = state_of(request)
        if num_matched:
            state.anchored_misses = 0
        else:
            state.anchored_misses += 1
            state.anchored_skip = policy.lookup_cooldown(state.anchored_misses)


def _lookup_missed(request: Request) -> None:
    state = state_of(request)
    state.lookup_misses += 1
    state.lookup_skip = policy.lookup_cooldown(state.lookup_misses)
