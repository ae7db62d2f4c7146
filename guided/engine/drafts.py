"""A constrained request's next drafts and what its last ones taught: forced text (then prompt
lookup) from jump_forward.py, anchored on the in-flight sample under overlapped scheduling, and
the cool-downs that stop proposing guesses that keep missing."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guided.config import EngineConfig
from guided.fsm.jump_forward import CachedEncoder, DraftAsk, make_drafts
from guided.engine.ngram import NgramIndex
from guided.scheduler import policy
from guided.scheduler.request import Request
from guided.scheduler.scheduler import ScheduledRequest
from guided.engine.step_times import StepTimes

if TYPE_CHECKING:
    from guided.fsm.shard_drafts import PendingDrafts, ShardDrafts

log = logging.getLogger(__name__)


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
    min_gain: float = 0.5
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
    def __init__(self, config: EngineConfig, encoder: CachedEncoder, token_bytes: list[bytes],
                 *, max_model_len: int, max_draft_tokens: int | None,
                 special_ids: frozenset[int], overlap: bool,
                 payoff: AnchorPayoff | None = None, shards: ShardDrafts | None = None):
        self.config = config
        self.payoff = payoff or AnchorPayoff(min_gain=config.min_anchor_gain)
        self.encoder = encoder
        self.token_bytes = token_bytes
        self.max_model_len = max_model_len
        self.max_draft_tokens = max_draft_tokens or config.max_jump_forward_tokens
        self.special_ids = special_ids
        self.overlap = overlap  # the next step assumes the drafts in flight accepted
        self.shards = shards  # mask shards, which walk the drafts of requests they mirror
        self._asks: list[tuple[Request, DraftAsk]] = []  # planned, to walk here
        self._asked: PendingDrafts | None = None  # planned, walked in mask shards

    def ask(self, requests: list[Request], *, num_running: int, times: StepTimes) -> None:
        """Plans the requests' next drafts; those a mask shard mirrors are sent there, to be
        walked beside the loop until finish()."""
        with times.phase("jump_forward"):
            self.payoff.start_step()
            asks = [(r, ask) for r in requests if not r.is_finished
                    and (ask := self.plan(r, num_running=num_running)) is not None]
            self._asks, self._asked = asks, None
            if self.shards is not None and asks:
                self._asks, self._asked = self.shards.ask_drafts(asks)

    def finish(self, times: StepTimes) -> None:
        """The asked drafts set on their requests: walked here, or taken from the shards."""
        asks, asked, self._asks, self._asked = self._asks, self._asked, [], None
        with times.phase("jump_forward"):
            for request, ask in asks:
                self.propose_here(request, ask)
        if asks:
            times.count("drafts_local", len(asks))
        if asked is None:
            return
        with times.phase("drafts_wait"):
            done, failed = asked.wait()
        times.count("drafts_shards", len(done))
        for request, result in done:
            set_drafts(request, result)
        for request, ask in failed:  # its shard failed: the loop's matchers walk them
            self.propose_here(request, ask)

    def plan(self, request: Request, *, num_running: int = 1) -> DraftAsk | None:
        """The policy's half of a proposal for the request's next step (after the step in
        flight, if any): clears its draft_token_ids / draft_anchor / num_forced_drafts and
        says what the walk may look at (None: nothing to propose). Counts its cool-downs down.
        num_running: the batch size, which decides whether lookup guesses are drafted."""
        inflight = request.inflight
        room = min(request.max_tokens - len(request.output_token_ids),
                   self.max_model_len - request.num_tokens) - request.num_inflight_samples - 1
        room = min(room, self.config.max_jump_forward_tokens, self.max_draft_tokens)
        request.draft_token_ids, request.draft_anchor, request.num_forced_drafts = [], None, 0
        if room <= 0:
            return None
        if inflight is not None and not (self.overlap and request.anchored_skip) \
                and not self.payoff.allows(num_running):
            return None  # anchored drafts do not pay now
        lookup_tokens = (self.config.lookup_draft_tokens if policy.drafts_lookup(
            num_running, max_batch=self.config.lookup_max_batch) and self._lookup_ready(request)
            else 0)
        if self.overlap and request.anchored_skip:
            request.anchored_skip -= 1
            return None
        assumed = (None if inflight is None
                   else tuple(inflight.draft_token_ids[:inflight.num_live_drafts]))
        return DraftAsk(room, lookup_tokens, assumed)

    def propose_here(self, request: Request, ask: DraftAsk) -> None:
        """The walk's half, on the request's draft matcher in this process (the mask thread
        may be walking the request's other matcher meanwhile)."""
        try:
            lookup = None
            if ask.lookup_tokens:
                if request.ngram is None:
                    request.ngram = NgramIndex(self.special_ids)
                request.ngram.sync(request.prompt_token_ids, request.output_token_ids)
                lookup = request.ngram
            result = make_drafts(self.encoder, self.token_bytes, request.draft_matcher,
                                 request.output_token_ids, ask, lookup)
        except Exception:
            log.exception("jump-forward proposal failed for %s", request.request_id)
            result = None, [], 0
        set_drafts(request, result)

    def _lookup_ready(self, request: Request) -> bool:
        """Whether lookup guesses may be drafted (not while cooling down after misses)."""
        if request.lookup_skip:
            request.lookup_skip -= 1
            return False
        return bool(self.config.lookup_draft_tokens)


def set_drafts(request: Request, result: tuple[int | None, list[int], int]) -> None:
    """A proposal's (anchor, drafts, how many are forced text), made here or in a mask shard."""
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
            request.lookup_misses = 0
        elif num_matched == item.num_forced_drafts:  # the first guess was wrong
            _lookup_missed(request)
    if drafts and request.inflight is not None and not request.is_finished:
        # the next step assumed them all: a first draft missed costs it (one token, two steps)
        if num_matched:
            request.anchored_misses = 0
        else:
            request.anchored_misses += 1
            request.anchored_skip = policy.lookup_cooldown(request.anchored_misses)


def _lookup_missed(request: Request) -> None:
    request.lookup_misses += 1
    request.lookup_skip = policy.lookup_cooldown(request.lookup_misses)
