"""Builds a step's inputs (ids, positions, slot_mapping, block tables), runs the model, fills
the grammar bitmask on the host while the forward pass runs, and samples; multi-step calls are
worker/decode_steps.py's."""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

import torch

from guided.config import EngineConfig
from guided.masks.bitmask_fill import apply_bans
from guided.masks.step_masks import MaskFill
from guided.scheduler.scheduler import SchedulerOutput
from guided.engine.step_times import StepTimes
from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.cuda_graphs import MAX_QUERY_LEN, StepGraphs
from guided.worker.decode_steps import DecodeSteps
from guided.worker.device_timeline import DeviceTimeline
from guided.worker.host_bitmasks import HostBitmasks
from guided.worker.host_lists import list_tensor
from guided.worker.model_config import ModelConfig
from guided.worker.models.llama import LlamaForCausalLM
from guided.worker.sampler import RowSource, rows_for, sample_on_device
from guided.worker.step_io import LaunchedStep, RunnerOutput, SampledStep, StepInputs

log = logging.getLogger(__name__)

# fill_masks(bitmask) fills the bitmask rows of the constrained sampled rows and returns the
# filled masks: where each row went, and the token bans left to apply (on the device)
MaskFiller = Callable[[torch.Tensor], MaskFill]


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, config.dtype)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 state_dict: dict[str, torch.Tensor] | None, *, vocab_size: int,
                 step_times: StepTimes | None = None, shared_masks: bool = False):
        """shared_masks: mask rows in files mapped in memory, for mask shard processes."""
        if vocab_size > model_config.vocab_size:
            raise ValueError(f"tokenizer has {vocab_size} tokens but the model only "
                             f"{model_config.vocab_size} embedding rows")
        self.config = config
        self.times = step_times or StepTimes()
        self.model_config = model_config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.vocab_size = vocab_size  # the tokenizer's: logits columns past it are never sampled
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = self._build_model(state_dict)
        self.num_blocks = self._size_kv_cache()
        cfg = model_config
        # (L, 2, num_blocks + 1, block_size, Hkv, D): one allocation, per-layer (k, v) views;
        # the extra block is scratch space for the padding rows of CUDA graphs
        # zeroed on the CPU: the torch reference gathers whole blocks, unwritten slots included
        alloc = torch.zeros if self.device.type == "cpu" else torch.empty
        self.kv_cache = alloc(cfg.num_layers, 2, self.num_blocks + 1, self.block_size,
                              cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.mask_words = -(-vocab_size // 32)
        self._bitmasks = HostBitmasks(self.mask_words, self.device, shared=shared_masks)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="guided-mask")
        self._decode_steps = DecodeSteps(self)
        self.use_triton = self.device.type == "cuda"
        self.timeline = DeviceTimeline(config.device_timeline and self.use_triton)
        self.graphs = None
        if self.use_triton and config.cuda_graphs:
            self.graphs = StepGraphs(
                self.model, self.kv_caches, max_batch=min(config.max_num_seqs, 512),
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                block_size=self.block_size, scratch_block=self.num_blocks, device=self.device,
                max_step_tokens=config.max_num_batched_tokens)

    def _build_model(self, state_dict) -> LlamaForCausalLM:
        with torch.device("meta"):  # no time spent on an init the weights overwrite
            model = LlamaForCausalLM(self.model_config)
        model.to_empty(device=self.device)
        model.rope.reset_tables()
        for p in model.parameters():  # rope tables stay fp32
            p.data = p.data.to(self.dtype)
        if state_dict is None:
            model.init_random_(self.config.seed)
        else:
            model.load_hf_state_dict(state_dict)
        if self.device.type == "cuda" and self.config.compile_ops:
            model.use_compiled_ops()
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _size_kv_cache(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            # gpu_memory_utilization is this engine's share of the GPU (weights, activations and
            # KV together), as in vLLM, so two engines at 0.4 each fit on one GPU
            free, total = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            reserve = (self.config.max_num_batched_tokens
                       * (self.model_config.vocab_size * 4 + self.model_config.intermediate_size
                          * 8)) + (1 << 30)  # activations, logits, CUDA graphs
            budget = min(total * self.config.gpu_memory_utilization - weights, free) - reserve
        else:
            budget = self.config.cpu_kv_cache_gb * (1 << 30)
        num = int(budget // per_block)
        if num < 2:
            raise MemoryError(f"no room for the KV cache ({budget / 2**30:.2f} GiB left)")
        return num

    # -- one step -----------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, constrained: list[bool],
                placeholders: dict[int, int] | None = None) -> StepInputs:
        """placeholders: scheduled index -> the previous step's sampled row whose token is this
        request's next input (overlapped scheduling: that token is not on the host yet)."""
        bs = self.block_size
        placeholders = placeholders or {}
        placeholder_index: list[int] = []
        placeholder_row: list[int] = []
        row_of_request: dict[str, int] = {}
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        row_owner: list[int] = []
        mask_rows: list[int] = []
        sources: list[RowSource] = []
        num_mask_rows = 0
        max_blocks = max(len(item.request.block_ids) for item in sched.scheduled)
        tables: list[list[int]] = []
        # per request, not per token or row: a verify step at 256 requests has ~700 of each
        # (benchmarks/bench_prepare.py)
        for b, item in enumerate(sched.scheduled):
            req = item.request
            start = req.num_computed_tokens + req.num_inflight_tokens
            num_drafts = item.num_draft_tokens
            n = item.num_new_tokens + num_drafts
            table = req.block_ids
            tables.append(table + [0] * (max_blocks - len(table)))
            pending_row = placeholders.get(b)
            if pending_row is not None:  # its one new token is the in-flight sample,
                placeholder_index.append(len(ids))  # gathered on the device at launch
                placeholder_row.append(pending_row)
                ids.append(0)
                ids.extend(item.draft_token_ids[:num_drafts])
            else:
                known = req.num_tokens
                ids.extend(req.token_at(pos) if pos < known
                           else item.draft_token_ids[pos - known] for pos in range(start, start + n))
            positions.extend(range(start, start + n))
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                slots.extend([table[pos // bs] * bs + pos % bs for pos in range(start, start + n)])
            query_start.append(len(ids))
            seq_lens.append(start + n)
            if not item.sample:
                continue
            count = 1 + num_drafts
            row_of_request[req.request_id] = len(logits_indices)
            logits_indices.extend(range(len(ids) - count, len(ids)))
            row_owner.extend([b] * count)
            if constrained[b]:
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
                else None))
        rows = rows_for(sources)
        dev = self.device
        query_lens = [b - a for a, b in pairwise(query_start)]
        meta = AttentionMetadata(
            slot_mapping=list_tensor(slots, torch.int64).to(dev, non_blocking=True),
            block_tables=list_tensor(tables, torch.int32).to(dev, non_blocking=True),
            query_start_loc=list_tensor(query_start, torch.int32).to(dev, non_blocking=True),
            seq_lens=list_tensor(seq_lens, torch.int32).to(dev, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            use_triton=self.use_triton,
        )
        return StepInputs(
            input_ids=list_tensor(ids, torch.int64).to(dev, non_blocking=True),
            positions=list_tensor(positions, torch.int64).to(dev, non_blocking=True),
            meta=meta,
            logits_indices=list_tensor(logits_indices, torch.int64).to(dev, non_blocking=True),
            rows=rows, row_owner=row_owner, mask_rows=mask_rows, num_mask_rows=num_mask_rows,
            query_lens=query_lens,
            has_drafts=any(item.num_draft_tokens for item in sched.scheduled),
            placeholder_index=placeholder_index, placeholder_row=placeholder_row,
            row_of_request=row_of_request)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, constrained: list[bool],
                fill_masks: MaskFiller) -> RunnerOutput:
        """One synchronous step: the masks are filled on the mask thread during the forward."""
        with self.times.phase("prepare"):
            inputs = self.prepare(sched, constrained)
        bitmask_host = self.new_bitmask(inputs.num_mask_rows)
        mask_job = None
        if bitmask_host is not None:
            mask_job = self._mask_pool.submit(fill_masks, bitmask_host)
        launched = self.launch(inputs)
        masks = None
        if mask_job is not None:
            with self.times.phase("mask_wait"):
                masks = mask_job.result()
        step = self.sample(launched, bitmask_host, masks, sched)
        with self.times.phase("sample_and_sync"):
            return step.result()

    def new_bitmask(self, num_rows: int) -> torch.Tensor | None:
        return self._bitmasks.take(num_rows) if num_rows else None

    def bitmask_segment(self, bitmask: torch.Tensor) -> tuple[str, int] | None:
        """(file, capacity in rows) where a shared bitmask lies, for mask shards; else None."""
        return self._bitmasks.segment_of(bitmask)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, previous: torch.Tensor | None = None) -> LaunchedStep:
        """Queue the forward pass and the logits. previous: the last step's sampled ids on the
        device, where the placeholder inputs come from (queued after that step's sampling)."""
        with self.times.phase("forward_launch"):
            self.timeline.mark("forward")
            if inputs.placeholder_index:
                index = list_tensor(inputs.placeholder_index, torch.int64)
                rows = list_tensor(inputs.placeholder_row, torch.int64)
                inputs.input_ids[index.to(self.device, non_blocking=True)] = previous[
                    rows.to(self.device, non_blocking=True)]
            hidden, kind = self._forward(inputs)
            logits = None
            if inputs.logits_indices.numel():
                logits = self.model.compute_logits(hidden[inputs.logits_indices])  # (N, V)
            self.timeline.mark(f"{kind} end")
        return LaunchedStep(inputs, logits, self._mark_forward_done())

    def _mark_forward_done(self) -> torch.cuda.Event | None:
        """An event the device reaches once the work queued so far (a forward pass) is done;
        None on the CPU, where that work ran within its launch."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, bitmask_host: torch.Tensor | None,
               masks: MaskFill | None = None, sched: SchedulerOutput | None = None
               ) -> SampledStep:
        """Queue the masked sampling and the copy of its ids to the host (not waited for).
        masks: where the filler put each row (rows that allow everything: none), and the
        token bans it left to apply (here, on the device).
        sched: the step's requests; with lazy_mask_candidates, the rows of those sampled
        without their mask bring back their best tokens too, for the host to pick the first
        the grammar takes (kernels/candidates.py), except rows that report logprobs (the
        sampled token's)."""
        inputs = launched.inputs
        if launched.logits is None:
            return SampledStep(inputs, None)
        candidate_rows = None
        if sched is not None and self.config.lazy_mask_candidates:
            unmasked = [item.lazy_mask for item in sched.scheduled]
            wants_logprobs = inputs.rows.num_logprobs
            candidate_rows = [row for row, owner in enumerate(inputs.row_owner)
                              if unmasked[owner] and wants_logprobs[row] < 0]
        self.timeline.mark("sample")
        bitmask = mask_rows = None
        rows = inputs.mask_rows
        if masks is not None and bitmask_host is not None:
            rows = masks.layout.mask_rows(rows)
            bitmask_host = bitmask_host[:masks.layout.num_rows] if masks.layout.num_rows else None
        if bitmask_host is not None:
            with self.times.phase("mask_upload"):
                bitmask = self._bitmasks.to_device(bitmask_host)
                if masks is not None and masks.bans:
                    apply_bans(bitmask, masks.bans)
                mask_rows = list_tensor(rows, torch.int32).to(self.device, non_blocking=True)
        with self.times.phase("sample_launch"):
            samples = sample_on_device(launched.logits, inputs.rows, bitmask, mask_rows,
                                       vocab_size=self.vocab_size, candidate_rows=candidate_rows,
                                       num_candidates=self.config.lazy_mask_candidates)
            self.timeline.mark("sample end")
        return SampledStep(inputs, samples)

    def execute_decode_steps(self, sched: SchedulerOutput, num_steps: int) -> RunnerOutput:
        """num_steps decode steps of a decode batch without scheduling between them
        (worker/decode_steps.py)."""
        return self._decode_steps.execute(sched, num_steps)

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, str]:
        """The hidden states, and how they were made: a graph's kind, or "eager"."""
        meta = inputs.meta
        num_tokens = inputs.input_ids.shape[0]
        key = None if self.graphs is None else self.graphs.pick(
            meta, num_tokens, has_drafts=inputs.has_drafts)
        if key is not None:
            self.times.count(f"graph_{key[0]}")
            return self.graphs.run(key, inputs.input_ids, inputs.positions, meta,
                                   inputs.query_lens), key[0]
        self.times.count("eager")
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta), "eager"

    def submit_host_job(self, fn: Callable[[], None]) -> Future:
        """Run fn on the mask thread (jobs, and the steps' mask fills, run there in order)."""
        return self._mask_pool.submit(fn)

    @property
    def max_draft_tokens(self) -> int | None:
        """Drafts per request that keep a verify step inside a CUDA graph (None: no limit)."""
        return None if self.graphs is None else MAX_QUERY_LEN - 1

    def shutdown(self) -> None:
        self._mask_pool.shutdown(wait=False)
        self._bitmasks.release()
