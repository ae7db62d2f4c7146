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
# up to this many prompt-lookup draft tokens past the forced text (the last 2-4 tokens matched
# earlier in the request's tokens), verified like the forced ones
LOOKUP_DRAFT_TOKENS = 4
# lookup guesses only while at most this many requests run, as vLLM turns speculation off by
# batch size: past the GPU's memory-bound knee a guess costs verify compute, a mask row and its
# proposal (H200, default model at 256: constrained throughput +9% without them; RESULTS,
# session 10)
LOOKUP_MAX_BATCH = 128
# overlapped scheduling: drafts anchored on a request's in-flight sample only while such
# proposals gain at least this many tokens each on average (a random-weights model gains ~0 and
# its drafts cost more than they save; RESULTS, session 11)
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
    """What anchored proposals gained lately, over all requests (whether the model writes the
    grammar's forced text in the tokens drafted is the model's trait): a running mean of the
    tokens each gained against an unanchored step. A hit gains its kept drafts, less the step
    after it when a draft was rejected (that step, in flight, assumed them all: it is voided);
    a miss gains nothing (its first row stands, its drafts' rows were spent).

    While the mean is below the bar, one step in probe_every (at random) still anchors about
    probes_per_step of its proposals (at random: a fixed stride would probe the same requests
    of a steady batch), to see again. Few probes, gathered in few steps: each probe may void
    its request's next step, and any draft in a step makes it a verify step whose padded
    tokens a large model pays for in every layer (one in eight proposals probed at 256
    requests made 103-141 of ~270 steps verify steps on a random 8B, benchmarks/RESULTS.md,
    session 17)."""
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
        """Once a step, before its proposals."""
        self.probing = self.rng.random() * self.probe_every < 1

    def allows(self, num_running: int = 1) -> bool:
        if policy.anchoring_pays(self.mean_gain, min_gain=self.min_gain):
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
        """The policy's half of a proposal for the request's next step (after the step in
        flight, if any): clears its draft_token_ids / draft_anchor / num_forced_drafts and
        says what the walk may look at (None: nothing to propose). Counts its cool-downs down.
        num_running: the batch size, which decides whether lookup guesses are drafted."""
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
        lookup_tokens = (LOOKUP_DRAFT_TOKENS if policy.drafts_lookup(
            num_running, max_batch=LOOKUP_MAX_BATCH) and self._lookup_ready(request) else 0)
        if self.overlap and state.anchored_skip:
            state.anchored_skip -= 1
            return None
        assumed = (None if inflight is None
                   else tuple(inflight.draft_token_ids[:inflight.num_live_drafts]))
        return DraftAsk(room, lookup_tokens, assumed)

    def walk(self, request: Request, ask: DraftAsk) -> None:
        """The walk's half, on the request's matcher (left where it was)."""
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
        set_drafts(request, result)

    def _lookup_ready(self, request: Request) -> bool:
        """Whether lookup guesses may be drafted (not while cooling down after misses)."""
        state = state_of(request)
        if state.lookup_skip:
            state.lookup_skip -= 1
            return False
        return True


def set_drafts(request: Request, result: tuple[int | None, list[int], int]) -> None:
    """A proposal's (anchor, drafts, how many are forced text)."""
    request.draft_anchor, request.draft_token_ids, request.num_forced_drafts = result


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
