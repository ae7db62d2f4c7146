"""Engine: add_request / abort_request / step. One synchronous step: schedule -> execute (masks
filled on the host while the model runs) -> sample -> update (append, verify drafts, stops) ->
outputs. On the GPU steps overlap (overlap.py): the host updates t while the device runs t+1."""
from __future__ import annotations

import logging
import random
import time

from guided.config import EngineConfig
from guided.engine.detokenizer import detokenize_final, fast_decode
from guided.engine.drafts import AnchorPayoff, DraftProposer, note_anchor_missed, note_verified
from guided.errors import InvalidRequestError, OverloadedError
from guided.masks.bitmask_fill import NUM_CPUS
from guided.fsm.jump_forward import CachedEncoder
from guided.masks.lazy import OUTSIDE, LazyGate, accept_unmasked_row, may_sample_unmasked
from guided.masks.prefetch import MaskPrefetch
from guided.fsm.mask_shards import MaskShards
from guided.masks.step_masks import MaskFill, fill_step_masks, start_step_masks
from guided.engine.heap import freeze_startup_heap, thaw_heap
from guided.outputs import EngineStats, RequestOutput
from guided.engine.overlap import OverlappedSteps
from guided.params import SamplingParams
from guided.engine.prompts import eos_token_ids, prompt_token_ids
from guided.scheduler import policy
from guided.scheduler.block_manager import BlockManager
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import Scheduler, SchedulerOutput
from guided.engine.step_times import StepTimes
from guided.engine.append import append_tokens
from guided.worker import loader
from guided.worker.model_runner import ModelRunner, resolve_device

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig.from_kwargs(**kwargs)
        t0 = time.perf_counter()
        self.model_name = config.model
        self.tokenizer = loader.load_tokenizer(config.model)
        model_config = loader.load_model_config(config.model)
        state = None if config.model.startswith("synthetic:") else loader.load_state_dict(
            config.model)
        self.vocab_size = len(self.tokenizer)  # the runner checks the model has as many rows
        self.step_times = StepTimes()
        on_gpu = resolve_device(config).type == "cuda"
        self.overlap = (config.async_scheduling if config.async_scheduling is not None
                        else on_gpu and config.num_scheduler_steps == 1)
        shards = policy.default_mask_processes(
            overlapped=self.overlap, on_gpu=on_gpu, num_cpus=NUM_CPUS,
            num_params=model_config.num_params)
        self.mask_processes = shards if config.mask_processes is None else config.mask_processes
        self.compile_config = policy.resolve_compile_config(config, on_gpu=on_gpu,
                                                            num_cpus=NUM_CPUS)
        self.runner = ModelRunner(config, model_config, state, vocab_size=self.vocab_size,
                                  step_times=self.step_times, shared_masks=self.mask_processes > 0)
        del state
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.set_lazy_masks(config.lazy_masks if config.lazy_masks is not None else self.overlap)
        self._lazy_gate = LazyGate()
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self._prefetch = MaskPrefetch(self.runner.submit_host_job, self.runner.mask_words,
                                      num_threads=config.mask_threads)
        self.eos_token_ids = eos_token_ids(self.tokenizer)
        self._special_ids = frozenset(self.tokenizer.all_special_ids) | set(self.eos_token_ids)
        self._encoder = CachedEncoder(self.tokenizer)  # retokenizes forced text
        self._decode = fast_decode(self.tokenizer)  # incremental detokenization
        self._compiler = None
        self._shards: MaskShards | None = None  # started with the compiler
        self._drafts: DraftProposer | None = None
        self.anchor_payoff = AnchorPayoff(min_gain=config.min_anchor_gain)
        self.requests: dict[str, Request] = {}
        self._to_propose: list[Request] = []  # moved on by the last update, drafts to make
        self._changed: dict[str, Request] = {}  # requests with news for the next outputs
        self._rng = random.Random(config.seed)
        self._overlapped = OverlappedSteps(
            self.runner, self.scheduler, self.step_times,
            start_masks=lambda sched, bitmask: start_step_masks(
                sched, bitmask, num_threads=config.mask_threads, times=self.step_times,
                shards=self._shards, segment=self.runner.bitmask_segment(bitmask),
                lazy_min_allowed=self._lazy_min_allowed),
            update=lambda sched, result: self._update(sched, result.sampled, result.logprobs,
                                                      result.candidates),
            ask_drafts=self._ask_drafts, propose=self._propose,
            concurrent_masks=config.concurrent_masks,
        ) if self.overlap else None
        self.stats_totals = EngineStats()
        if self.mask_processes:
            self.compiler  # starts the shards now: they take seconds to import
        freeze_startup_heap()  # full collections would walk it every time (guided/engine/heap.py)
        log.info("engine ready in %.1f s: model %s on %s (%s), %d KV blocks x %d tokens, "
                 "max_model_len %d, %s scheduling, %d mask shards", time.perf_counter() - t0,
                 config.model, self.runner.device, str(self.runner.dtype).removeprefix("torch."),
                 self.runner.num_blocks, config.block_size, self.max_model_len,
                 "overlapped" if self.overlap else "synchronous", self.mask_processes)

    @property
    def compiler(self):
        """The grammar compiler, built on first use (its backends are heavy imports)."""
        if self._compiler is None:
            from guided.fsm.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                             config=self.compile_config)
            if self.mask_processes:
                v = self._compiler.vocab  # the shards walk drafts too, given the tokenizer
                drafting = None if self._encoder.backend_json is None else (
                    self._encoder.backend_json, v.token_bytes, v.eos_token_ids, self._special_ids)
                self._shards = MaskShards(
                    self._compiler.xgrammar_tokenizer_info, self.mask_processes,
                    drafting=drafting, times=self.step_times,
                    idle=self.compile_config.compile_sched_idle,
                    compile_threads=self.compile_config.xgrammar_threads)
        return self._compiler

    @property
    def drafts(self) -> DraftProposer:
        """Jump-forward proposals (built with the compiler: constrained requests only)."""
        if self._drafts is None:
            self._drafts = DraftProposer(
                self.config, self._encoder, self.compiler.vocab.token_bytes,
                max_model_len=self.max_model_len, max_draft_tokens=self.runner.max_draft_tokens,
                special_ids=self._special_ids, overlap=self.overlap, payoff=self.anchor_payoff,
                # not beside concurrent_masks: its mask thread reads the shards' pipes too
                shards=None if self.config.concurrent_masks else self._shards)
        return self._drafts

    def set_lazy_masks(self, on: bool) -> None:
        """Lazy masks on or off between steps (benchmarks compare both on one warm engine)."""
        self.lazy_masks = on
        self._lazy_min_allowed = self.config.lazy_mask_min_allowed if on else None

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.scheduler.num_unfinished >= self.config.max_waiting_requests:
            raise OverloadedError(f"{self.scheduler.num_unfinished} requests in flight; retry later")
        prompt_ids = prompt_token_ids(self.tokenizer, prompt, vocab_size=self.vocab_size,
                                      max_model_len=self.max_model_len)
        spec = params.constraint  # raises ConstraintError for a malformed spec
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_ids, params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(63),
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids, max_tokens=max_tokens)
        request.metrics.arrival_time = arrival_time or time.time()
        request.logprobs = [] if params.logprobs is not None else None
        self.requests[request_id] = request
        self.stats_totals.prompt_tokens_total += len(prompt_ids)
        if max_tokens <= 0:
            return self._finish(request, "length")
        if spec is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            request.grammar_future = self.compiler.submit(spec)
        self.scheduler.add(request)
        log.debug("added %s: %d prompt tokens, %s", request_id, len(prompt_ids), spec and spec.kind)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, "abort")  # its text so far comes with its output

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self._changed)
                or self._overlapped is not None and self._overlapped.in_flight)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        times = self.step_times
        with times.phase("promote"):
            for request in self.scheduler.promote_compiled(self._make_matcher):
                request.error_type = "constraint"
                self._finish(request, "error", error=request.error)
        if self._overlapped is not None:
            self._overlapped.step()
            if self.lazy_masks:  # only while the host bounds the step
                self._lazy_min_allowed = (self.config.lazy_mask_min_allowed
                                          if self._lazy_gate.observe(times) else None)
            with times.phase("outputs"):
                return self._collect_outputs()
        with times.phase("schedule"):
            sched = self.scheduler.schedule()
        if sched.scheduled:
            num_steps = self.scheduler.plan_decode_steps(sched)
            if num_steps > 1:
                times.count("multi_steps")
                self._prefetch.clear()  # rows filled ahead are one step's: the steps move on
                result = self.runner.execute_decode_steps(sched, num_steps)
            else:
                times.count("steps")
                result = self.runner.execute(sched, [item.masked for item in sched.scheduled],
                                             lambda bitmask: self._fill_masks(sched, bitmask))
                self._prefetch.clear()  # consumed: the update below moves the matchers on
            with times.phase("update"):
                self._update(sched, result.sampled, result.logprobs, result.candidates,
                             num_steps=num_steps, accepted=result.accepted)
            self._ask_drafts()
            self._propose()
            if num_steps == 1 and self._shards is None:  # none constrained: nothing to start
                self._prefetch.start([r for r in self.scheduler.running if r.matcher is not None
                                      and not r.is_finished and r.side_fill is None
                                      and not (self.lazy_masks and may_sample_unmasked(r))])
        return self._collect_outputs()

    def _make_matcher(self, request: Request) -> None:
        grammar = request.grammar_future.result()  # raises ConstraintError on a failed compile
        request.matcher = grammar.matcher()
        if self.config.jump_forward:  # its own where a mask thread or a side fill kept past
            # a step or a call (a heavy row's) walks `matcher` meanwhile
            own = self.overlap and self.config.concurrent_masks or request.matcher.heavy and (
                self.overlap or self.config.num_scheduler_steps > 1)
            request.draft_matcher = grammar.matcher() if own else request.matcher
        if request.params.json_schema is not None or request.params.json_object:
            request.json_string = OUTSIDE  # its text's strings end its lazy runs
        request.metrics.compiled_time = time.time()
        request.metrics.compile_seconds = grammar.compile_seconds

    def _fill_masks(self, sched: SchedulerOutput, bitmask) -> MaskFill:
        """Runs on the mask thread while the forward pass runs."""
        with self.step_times.phase("mask_fill (thread)"):  # overlaps the forward pass
            return fill_step_masks(sched, bitmask, num_threads=self.config.mask_threads,
                                   times=self.step_times, prefetch=self._prefetch,
                                   shards=self._shards,
                                   segment=self.runner.bitmask_segment(bitmask),
                                   lazy_min_allowed=self._lazy_min_allowed)

    def _update(self, sched: SchedulerOutput, sampled: list[list[int]], logprobs: list[list],
                candidates: dict[int, dict[int, list[int]]] | None = None, *,
                num_steps: int = 1, accepted: frozenset[int] = frozenset()) -> None:
        """num_steps > 1: a request's tokens come from consecutive decode steps, not drafts
        (a row may have fewer: a late heavy row stopped); the rows in `accepted` were fed to
        their matchers already. candidates: rows sampled unmasked, their best tokens
        (RunnerOutput.candidates)."""
        candidates = candidates or {}
        self.stats_totals.forward_passes_total += num_steps  # one forward pass a step
        for b, (item, tokens, lps) in enumerate(zip(sched.scheduled, sampled, logprobs)):
            request = item.request
            if item.voided:  # it assumed drafts its previous step rejected
                self.step_times.count("voided_rows")
                continue
            if request.is_finished:  # finished (or aborted) while the step ran
                continue
            request.metrics.forward_passes += num_steps
            # preempted while the step ran: its tokens stand, its cache is gone
            keep_cache = request.status is RequestStatus.RUNNING
            base = request.num_computed_tokens + item.num_new_tokens
            if not item.sample:
                if keep_cache:
                    self.scheduler.commit_computed(request, base)
                continue
            if num_steps > 1:  # tokens past a finish are dropped; drafts made before are stale
                request.draft_token_ids, request.draft_anchor = [], None
                num_appended = self._append(request, tokens, None, accepted=b in accepted)
                if not request.is_finished:  # all but the last token were fed to the model
                    self.scheduler.commit_computed(request, base + num_appended - 1)
                    self.scheduler.trim_blocks(request)
                    if self.config.jump_forward and request.matcher is not None:
                        self._to_propose.append(request)
                continue
            drafts = item.draft_token_ids
            if item.drafts_void:  # anchored on a token the previous step did not sample
                self.step_times.count("anchor_misses")
                note_anchor_missed(request, item, self.anchor_payoff)
                drafts, tokens = [], tokens[:1]
            elif item.anchor is not None:
                self.step_times.count("anchor_hits")
            # used now; the proposal below makes the next ones
            request.draft_token_ids, request.draft_anchor = [], None
            # the tokens that stand: each row after a draft its previous row's token matched
            stand = 1
            while stand < len(tokens) and tokens[stand - 1] == drafts[stand - 1]:
                stand += 1
            missed = replaced = False
            if item.late_mask:  # sampled without its rows (still filling): runs again
                self.step_times.count("late_rows")
                stand, missed = 0, True
            elif item.lazy_mask:  # sampled unmasked: one outside the grammar is replaced
                checked = accept_unmasked_row(request, tokens, stand, candidates.get(b))
                tokens, stand, missed, replaced = (checked.tokens, checked.stand,
                                                   checked.missed, checked.replaced)
            num_appended = self._append(request, tokens[:stand], lps, accepted=item.lazy_mask)
            # a matched draft's K/V, computed this step, is now valid; an appended token that
            # finished the request does not count
            ended = request.is_finished and request.finish_reason != "error"
            num_matched = min(num_appended - ended, stand - 1 + missed)
            request.metrics.jump_forward_tokens += num_matched
            self.stats_totals.jump_forward_tokens_total += num_matched
            if not missed:  # a miss says nothing of the drafts (a masked row may have kept them)
                note_verified(request, item, drafts, num_matched, self.anchor_payoff)
            if request.is_finished:
                continue
            if missed or replaced:  # the step in flight ran on that sample: voided
                if not item.late_mask:
                    self.step_times.count("lazy_misses" if missed else "lazy_replaced")
                request.mask_wide = False
            self.scheduler.settle_in_flight(
                request, kept_all_drafts=num_matched == len(drafts) and not missed
                and not replaced)
            if keep_cache:  # a missed position's input runs again, for its logits
                self.scheduler.commit_computed(request, base + num_matched - missed)
                self.scheduler.trim_blocks(request)
            if self.config.jump_forward and request.matcher is not None:
                self._to_propose.append(request)

    def _ask_drafts(self) -> None:
        """Plans drafts for the requests the update moved on (shards walk theirs meanwhile)."""
        to_propose, self._to_propose = self._to_propose, []
        if to_propose or self._drafts is not None:  # also forgets asks of a failed step
            self.drafts.ask(to_propose, num_running=len(self.scheduler.running),
                            times=self.step_times)

    def _propose(self) -> None:
        """The drafts asked for (under overlap, the fill started meanwhile)."""
        if self._drafts is not None:
            self._drafts.finish(self.step_times)

    def _append(self, request: Request, tokens: list[int], logprobs: list | None, *,
                accepted: bool = False) -> int:
        """Appends a row's tokens (accepted: its matchers hold them already); returns how many
        were appended (tokens past a finish are dropped)."""
        num, finish = append_tokens(request, tokens, logprobs, accepted=accepted,
                                    decode=self._decode,
                                    token_bytes=self.compiler.vocab.token_bytes
                                    if request.json_string is not None else (),
                                    max_model_len=self.max_model_len,
                                    decode_at_finish=False)  # decoded with the outputs
        if num:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.time()
            self.stats_totals.generation_tokens_total += num
            if request.params.output_kind == "cumulative":  # else its finish reports it
                self._changed[request.request_id] = request
        if finish is not None:
            if finish.reason == "error":
                request.error_type = "internal"
            self._finish(request, finish.reason, error=finish.error,
                         stop_reason=finish.stop_reason)
        return num

    def _finish(self, request: Request, reason: str, *, error: str | None = None,
                stop_reason=None) -> None:
        request.draft_token_ids, request.draft_anchor = [], None
        if self._shards is not None:
            self._shards.release(request.request_id)
        self.scheduler.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error if error is not None else request.error
        request.metrics.finished_time = time.time()
        counts = self.stats_totals.requests_finished_total
        counts[reason] = counts.get(reason, 0) + 1
        self._changed[request.request_id] = request
        log.debug("request %s finished: %s (%d tokens)", request.request_id, reason,
                  len(request.output_token_ids))

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request in self._changed.values():
            # decoded here, not where it finished: under overlap the outputs are collected
            # after the next step's launch, so a batch finishing together (135 requests at
            # 256 tokens: 20-30 ms) no longer holds up a sampling (RESULTS, session 21)
            if request.is_finished and not request.params.text_per_step:
                detokenize_final(self._decode, request)
            outputs.append(request.output())
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        self._changed = {}
        return outputs

    def stats(self) -> EngineStats:
        s = self.stats_totals
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.compiling),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_in_use=self.block_manager.num_used_blocks,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            prefix_cache_queries_total=self.scheduler.prefix_queries,
            prefix_cache_hit_tokens_total=self.scheduler.prefix_hits,
            jump_forward_tokens_total=s.jump_forward_tokens_total,
            forward_passes_total=s.forward_passes_total,
            preemptions_total=self.scheduler.num_preemptions,
            requests_finished_total=dict(s.requests_finished_total))

    def shutdown(self) -> None:
        if self._shards is not None:
            self._shards.shutdown()
        if self._compiler is not None:
            self._compiler.shutdown()
        self.runner.shutdown()
        thaw_heap()  # the engine's own cycles collectable again
