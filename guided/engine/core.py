"""Engine: add_request / abort_request / step.

A step: schedule -> launch the forward pass -> fill the grammar masks -> sample -> update
(append, verify drafts, stops) -> outputs. Overlapped scheduling is the loop's depth: at depth 1
(a GPU) the host reads step t's tokens, fills step t+1's masks and samples it, then proposes
drafts and launches t+2 while the device runs t+1; at depth 0 (the CPU) the same calls run and
each step is read before the next is scheduled. The worker sees a step as two values: its
SchedulerOutput and its StepMasks."""
from __future__ import annotations

import logging
import random
import time
from concurrent import futures
from dataclasses import dataclass

from guided.config import EngineConfig
from guided.engine.append import append_prompt_logprobs, append_tokens
from guided.engine.detokenizer import detokenize_final, fast_decode, held_back
from guided.engine.drafts import AnchorPayoff, DraftProposer, note_anchor_missed, note_verified
from guided.engine.heap import freeze_startup_heap, thaw_heap
from guided.engine.prompts import eos_token_ids, prompt_token_ids
from guided.errors import InvalidRequestError, OverloadedError
from guided.fsm.jump_forward import CachedEncoder
from guided.fsm.settings import CompileSettings
from guided.masks.step_masks import fill_step_masks
from guided.outputs import EngineStats, RequestOutput
from guided.params import SamplingParams
from guided.scheduler.block_manager import BlockManager
from guided.scheduler.output import RowMap, build_output
from guided.scheduler.request import Request, RequestStatus
from guided.scheduler.scheduler import ScheduledRequest, Scheduler, StepPlan
from guided.worker import loader
from guided.worker.model_runner import make_executor, resolve_device
from guided.worker.step_io import RunnerOutput, SampledTokens
from guided.worker.step_times import StepTimes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlight:
    """A step between its launch and its update."""
    plan: StepPlan
    rows: RowMap
    mask_rows: list[int]  # (N,) per sampled row its bitmask row, -1: unconstrained
    num_mask_rows: int
    sampled: SampledTokens | None = None


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig.from_kwargs(**kwargs)
        t0 = time.perf_counter()
        self.model_name = config.model
        self.tokenizer = loader.load_tokenizer(config.model)
        model_config = loader.load_model_config(config.model)
        self.vocab_size = len(self.tokenizer)  # the runner checks the model has as many rows
        self.step_times = StepTimes()
        on_gpu = resolve_device(config).type == "cuda"
        overlap = config.async_scheduling if config.async_scheduling is not None else on_gpu
        self.depth = 1 if overlap else 0  # steps in flight while the host works
        self.compile_settings = CompileSettings.for_host(
            any_whitespace=config.any_whitespace, compile_timeout_s=config.compile_timeout_s,
            on_gpu=on_gpu)
        self.executor = make_executor(config, model_config, vocab_size=self.vocab_size,
                                      step_times=self.step_times)
        self.runner = getattr(self.executor, "runner", None)  # in-process (tensor parallel 1)
        self.max_model_len = self.executor.max_model_len
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.eos_token_ids = eos_token_ids(self.tokenizer)
        self._special_ids = frozenset(self.tokenizer.all_special_ids) | set(self.eos_token_ids)
        self._encoder = CachedEncoder(self.tokenizer)  # retokenizes forced text
        self._decode = fast_decode(self.tokenizer)  # incremental detokenization
        self._compiler = None
        self._drafts: DraftProposer | None = None
        self.anchor_payoff = AnchorPayoff()
        self.requests: dict[str, Request] = {}
        self._to_propose: list[Request] = []  # moved on by the last update, drafts to make
        self._changed: dict[str, Request] = {}  # requests with news for the next outputs
        self._launched: InFlight | None = None  # forward pass queued, masks not applied
        self._sampled: InFlight | None = None  # tokens on their way to the host
        self._rng = random.Random(config.seed)
        self.stats_totals = EngineStats()
        freeze_startup_heap()  # full collections would walk it every time (engine/heap.py)
        log.info("engine ready in %.1f s: model %s on %s (%s, tensor parallel %d), %d KV blocks "
                 "x %d tokens, max_model_len %d, %s scheduling", time.perf_counter() - t0,
                 config.model, self.executor.device, self.executor.dtype,
                 config.tensor_parallel_size, self.executor.num_blocks, config.block_size,
                 self.max_model_len, "overlapped" if self.depth else "synchronous")

    @property
    def compiler(self):  # built on first use: its backends are heavy imports
        if self._compiler is None:
            from guided.fsm.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                             config=self.compile_settings)
        return self._compiler

    @property
    def drafts(self) -> DraftProposer:
        if self._drafts is None:
            self._drafts = DraftProposer(
                self._encoder, self.compiler.vocab.token_bytes, max_model_len=self.max_model_len,
                max_draft_tokens=self.executor.max_draft_tokens, special_ids=self._special_ids,
                overlap=self.depth > 0, payoff=self.anchor_payoff)
        return self._drafts

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.scheduler.num_unfinished >= self.config.max_waiting_requests:
            raise OverloadedError(f"{self.scheduler.num_unfinished} requests in flight; retry later")
        prompt_ids = prompt_token_ids(self.tokenizer, prompt, vocab_size=self.vocab_size,
                                      max_model_len=self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(f"logit_bias names token {max(params.logit_bias)}, past "
                                      f"the vocabulary's {self.vocab_size}", param="logit_bias")
        spec = params.constraint  # raises ConstraintError for a malformed spec
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_ids, params=params,
            seed=params.seed if params.seed is not None else self._rng.getrandbits(63),
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids, max_tokens=max_tokens)
        request.metrics.arrival_time = arrival_time or time.time()
        request.logprobs = [] if params.logprobs is not None else None
        request.prompt_logprobs = None if params.prompt_logprobs is None else [None]
        self.requests[request_id] = request
        self.stats_totals.prompt_tokens_total += len(prompt_ids)
        if max_tokens <= 0 and params.prompt_logprobs is None:  # else its prompt is scored
            return self._finish(request, "length")
        if spec is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            # offline, a batch may bring more new schemas than a server lets queue: all wait
            request.grammar_future = self.compiler.submit(spec, bounded=False)
        self.scheduler.add(request)
        log.debug("added %s: %d prompt tokens, %s", request_id, len(prompt_ids), spec and spec.kind)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, "abort")  # its text so far comes with its output

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self._changed)
                or self._launched is not None or self._sampled is not None)

    def wait_for_compiles(self, timeout: float) -> None:
        """While every unfinished request waits for its grammar, block until one compiles (or
        `timeout` passes): a caller with nothing to step waits here rather than spinning on
        step(), which held the GIL and a core from the compiles it waited for."""
        s = self.scheduler
        if s.running or s.waiting or self._launched is not None or self._sampled is not None:
            return
        pending = [request.grammar_future for request in s.compiling]
        if pending:
            futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        try:
            self._promote_compiled()
            if self._sampled is not None:  # step t: its tokens read, its requests moved on
                self._read_sampled()
            if self._launched is not None:  # step t+1: its masks filled, sampled
                self._sampled, self._launched = self._sample(self._launched), None
            self._propose_drafts()
            self._launched = self._launch_next()  # step t+2 (or t+1 at depth 0)
            if self.depth == 0 and self._launched is not None:  # nothing runs beside the host
                self._sampled, self._launched = self._sample(self._launched), None
                self._read_sampled()
        except Exception:
            # the steps in flight are lost: their requests go back to their committed tokens
            # (whose K/V are in the cache) and recompute from there
            self._launched = self._sampled = None
            self.executor.forget()
            self.scheduler.forget_in_flight()
            raise
        with self.step_times.phase("outputs"):
            return self._collect_outputs()

    def _promote_compiled(self) -> None:
        for request in self.scheduler.take_compiled():
            try:
                grammar = request.grammar_future.result()  # raises ConstraintError if it failed
                request.matcher = grammar.matcher()
            except Exception as e:  # noqa: BLE001 - a bad constraint fails its request only
                request.error_type = "constraint"
                self._finish(request, "error", error=str(e))
                continue
            request.metrics.compiled_time = time.time()
            request.metrics.compile_seconds = grammar.compile_seconds
            self.scheduler.admit_compiled(request)

    def _launch_next(self) -> InFlight | None:
        times = self.step_times
        with times.phase("schedule"):
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            return None
        times.count("steps")
        previous = self._sampled
        placeholders = {}
        if previous is not None:  # the last row of each request in the step in flight: its
            first = previous.rows.first_row  # drafts are assumed accepted
            placeholders = {b: first[item.request.request_id]
                            + item.request.inflight.num_live_drafts
                            for b, item in enumerate(plan.scheduled) if item.placeholder}
        with times.phase("build_output"):
            out, rows = build_output(plan, block_size=self.config.block_size,
                                     placeholders=placeholders)
        self.executor.launch(out)
        self.scheduler.launched(plan)
        return InFlight(plan, rows, out.mask_rows, out.num_mask_rows)

    def _sample(self, step: InFlight) -> InFlight:
        masks = None
        if step.num_mask_rows:
            filled = fill_step_masks(step.plan, self.executor.new_bitmask(step.num_mask_rows),
                                     step.mask_rows, times=self.step_times)
            masks = filled.masks
            for request, error in filled.failed:  # its sample is dropped by the update
                self._fail(request, error)
        step.sampled = self.executor.sample(masks)
        return step

    def _read_sampled(self) -> None:
        step, self._sampled = self._sampled, None
        with self.step_times.phase("sample_wait"):
            result = step.sampled.result()
        self.scheduler.landed(step.plan)
        with self.step_times.phase("update"):
            self._update(step.plan, step.rows, result)

    def _propose_drafts(self) -> None:
        to_propose, self._to_propose = self._to_propose, []
        if to_propose:
            self.drafts.propose(to_propose, num_running=len(self.scheduler.running),
                                times=self.step_times)

    # -- the update ---------------------------------------------------------------------------
    def _update(self, plan: StepPlan, rows: RowMap, result: RunnerOutput) -> None:
        self.stats_totals.forward_passes_total += 1
        sampled: list[list[int]] = [[] for _ in plan.scheduled]
        logprobs: list[list] = [[] for _ in plan.scheduled]
        for owner, token, lp in zip(rows.row_owner, result.token_ids, result.logprobs):
            sampled[owner].append(token)
            logprobs[owner].append(lp)
        append_prompt_logprobs(plan, rows, result.prompt_logprobs)
        for item, tokens, lps in zip(plan.scheduled, sampled, logprobs):
            if item.voided:  # it assumed drafts its previous step rejected
                self.step_times.count("voided_rows")
                continue
            if item.request.is_finished:  # finished (or aborted) while it ran
                continue
            try:
                self._update_request(item, tokens, lps)
            except Exception as e:  # noqa: BLE001 - one request's fault fails it alone
                log.exception("request %s failed in its update", item.request.request_id)
                self._fail(item.request, f"{type(e).__name__}: {e}")

    def _update_request(self, item: ScheduledRequest, tokens: list[int], lps: list) -> None:
        request = item.request
        request.metrics.forward_passes += 1
        # preempted while the step ran: its tokens stand, its cache is gone
        keep_cache = request.status is RequestStatus.RUNNING
        base = request.num_computed_tokens + item.num_new_tokens
        if not item.sample:
            if keep_cache:
                self.scheduler.commit_computed(request, base)
            return
        drafts = item.draft_token_ids
        if item.drafts_void:  # anchored on a token the previous step did not sample
            self.step_times.count("anchor_misses")
            note_anchor_missed(request, item, self.anchor_payoff)
            drafts, tokens = [], tokens[:1]
        elif item.anchor is not None:
            self.step_times.count("anchor_hits")
        # used now; the proposal after the update makes the next ones
        request.draft_token_ids, request.draft_anchor = [], None
        # the tokens that stand: each row after a draft its previous row's token matched
        stand = 1
        while stand < len(tokens) and tokens[stand - 1] == drafts[stand - 1]:
            stand += 1
        num_appended = self._append(request, tokens[:stand], lps)
        # a matched draft's K/V, computed this step, is now valid; an appended token that
        # finished the request does not count
        ended = request.is_finished and request.finish_reason != "error"
        num_matched = min(num_appended - ended, stand - 1)
        request.metrics.jump_forward_tokens += num_matched
        self.stats_totals.jump_forward_tokens_total += num_matched
        note_verified(request, item, drafts, num_matched, self.anchor_payoff)
        if request.is_finished:
            return
        self.scheduler.settle_in_flight(request, kept_all_drafts=num_matched == len(drafts))
        if keep_cache:
            self.scheduler.commit_computed(request, base + num_matched)
            self.scheduler.trim_blocks(request)
        if self.config.jump_forward and request.matcher is not None:
            self._to_propose.append(request)

    def _fail(self, request: Request, error: str) -> None:
        log.error("request %s failed inside a step: %s", request.request_id, error)
        request.error_type = "internal"
        self._finish(request, "error", error="internal engine error")

    def _append(self, request: Request, tokens: list[int], logprobs: list | None) -> int:
        """Appends a row's tokens up to a finish; returns how many."""
        num, finish = append_tokens(request, tokens, logprobs, decode=self._decode,
                                    max_model_len=self.max_model_len,
                                    decode_at_finish=False)  # decoded with the outputs
        if num:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.time()
            self.stats_totals.generation_tokens_total += num
            if request.params.output_kind == "cumulative":  # else its finish reports it
                self._changed[request.request_id] = request
        if finish is not None:
            error = finish.error
            if finish.reason == "error":
                request.error_type = "internal"
                if request.matcher is not None and not request.matcher.allows_a_token(
                        self.vocab_size):  # its row allowed nothing: the constraint's fault
                    request.error_type = "constraint"
                    error = ("the constraint cannot be completed with this model's vocabulary:"
                             f" no token may follow its {len(request.output_token_ids)} output"
                             " tokens (it needs bytes no token spells)")
            self._finish(request, finish.reason, error=error, stop_reason=finish.stop_reason)
        return num

    def _finish(self, request: Request, reason: str, *, error: str | None = None,
                stop_reason=None) -> None:
        request.draft_token_ids, request.draft_anchor = [], None
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
            # decoded here, after the next step's launch, not where it finished: a batch
            # finishing together does not hold up a sampling
            if request.is_finished and not request.params.text_per_step:
                detokenize_final(self._decode, request)
            outputs.append(output_of(request))
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
        if self._compiler is not None:
            self._compiler.shutdown()
        self.executor.shutdown()
        thaw_heap()  # the engine's own cycles collectable again


def output_of(request: Request) -> RequestOutput:
    """What the request has made so far (text that may start a stop string held back)."""
    text = request.text
    if not request.is_finished and request.params.stop_list:
        hold = held_back(text, request.params.stop_list)
        text = text[:len(text) - hold] if hold else text
    return RequestOutput(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
        token_ids=list(request.output_token_ids), text=text, finished=request.is_finished,
        finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        error=request.error, error_type=request.error_type,
        logprobs=None if request.logprobs is None else list(request.logprobs),
        metrics=request.metrics, prompt_logprobs=request.prompt_logprobs)  # done: never grows
