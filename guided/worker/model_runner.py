"""The worker: owns the model and its KV cache on one device; turns a SchedulerOutput into
tensors, queues the forward pass, and samples it under the step's masks (StepMasks). It knows no
request, grammar or scheduler: everything it needs comes in those two values."""
from __future__ import annotations

import logging

import torch

from guided.config import EngineConfig
from guided.scheduler.output import SchedulerOutput
from guided.worker.attention_metadata import AttentionMetadata
from guided.worker.cuda_graphs import MAX_QUERY_LEN, StepGraphs
from guided.worker.distributed import SINGLE, ParallelContext, rank_device
from guided.worker.host_bitmasks import HostBitmasks
from guided.worker.host_lists import list_tensor
from guided.worker.model_config import ModelConfig
from guided.worker.models.llama import build_model
from guided.worker.models.weights import WeightReader
from guided.worker.sampler import sample_on_device
from guided.worker.step_io import LaunchedStep, SampledStep, StepInputs, StepMasks
from guided.worker.step_times import StepTimes

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache on the CPU, unless num_kv_blocks says otherwise


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, config.dtype)


class ModelRunner:
    """One rank's worker: the whole model at ctx.world_size 1, else rank ctx.rank's shard of it
    (models/parallel.py) with the KV cache of its KV heads; the logits and the samples are whole
    and equal on every rank."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, reader: WeightReader, *,
                 vocab_size: int, ctx: ParallelContext = SINGLE,
                 step_times: StepTimes | None = None):
        if vocab_size > model_config.vocab_size:
            raise ValueError(f"tokenizer has {vocab_size} tokens but the model only "
                             f"{model_config.vocab_size} embedding rows")
        self.config = config
        self.ctx = ctx
        self.times = step_times or StepTimes()
        self.model_config = model_config
        self.device = resolve_device(config)
        if ctx.world_size > 1:  # one device per rank: cuda:LOCAL_RANK
            self.device = rank_device(self.device.type)
        self.dtype = resolve_dtype(config, self.device)
        self.vocab_size = vocab_size  # the tokenizer's: logits columns past it are never sampled
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = build_model(model_config, reader, device=self.device, dtype=self.dtype,
                                 ctx=ctx)
        if self.device.type == "cuda":
            self.model.use_compiled_ops()
        self.num_kv_heads = self.model.layout.num_kv_heads  # this rank's
        self.num_blocks = self._size_kv_cache()
        cfg = model_config
        # (L, 2, num_blocks + 1, block_size, Hkv, D): one allocation, per-layer (k, v) views;
        # the extra block is scratch space for the padding rows of CUDA graphs
        # zeroed on the CPU: the torch reference gathers whole blocks, unwritten slots included
        alloc = torch.zeros if self.device.type == "cpu" else torch.empty
        self.kv_cache = alloc(cfg.num_layers, 2, self.num_blocks + 1, self.block_size,
                              self.num_kv_heads, cfg.head_dim, dtype=self.dtype,
                              device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.mask_words = -(-vocab_size // 32)
        self._bitmasks = HostBitmasks(self.mask_words, self.device)
        self.use_triton = self.device.type == "cuda"
        self.graphs = None
        if self.use_triton and config.cuda_graphs:
            # at world size > 1 the graphs hold the layers' all-reduces (NCCL collectives are
            # captured like kernels); every rank captures the same graphs in the same order
            self.graphs = StepGraphs(
                self.model, self.kv_caches, max_batch=min(config.max_num_seqs, 512),
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                block_size=self.block_size, scratch_block=self.num_blocks, device=self.device,
                max_step_tokens=config.max_num_batched_tokens)

    def kv_bytes_per_block(self) -> int:
        """This rank's bytes of one KV block (its KV heads only)."""
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _size_kv_cache(self) -> int:
        """The blocks every rank has room for: a block id means the same tokens on each rank,
        so the rank with the least room sets the number (all ranks take part, even where one
        has no room, so that none waits for a rank that gave up)."""
        num = self._blocks_with_room()
        if self.ctx.world_size > 1:
            num = self.ctx.all_min(num)
        if num < 2:
            raise MemoryError(f"no room for the KV cache ({num} blocks of "
                              f"{self.kv_bytes_per_block() / 2**20:.1f} MiB on some rank)")
        return num

    def _blocks_with_room(self) -> int:
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
            budget = CPU_KV_CACHE_BYTES
        return max(int(budget // per_block), 0)

    # -- one step -----------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's tensors, their copies to the device queued."""
        dev = self.device
        query_lens = out.query_lens
        meta = AttentionMetadata(
            slot_mapping=list_tensor(out.slot_mapping, torch.int64).to(dev, non_blocking=True),
            block_tables=list_tensor(out.block_tables, torch.int32).to(dev, non_blocking=True),
            query_start_loc=list_tensor(out.query_start_loc, torch.int32).to(
                dev, non_blocking=True),
            seq_lens=list_tensor(out.seq_lens, torch.int32).to(dev, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(out.seq_lens),
            use_triton=self.use_triton,
        )
        return StepInputs(
            input_ids=list_tensor(out.input_ids, torch.int64).to(dev, non_blocking=True),
            positions=list_tensor(out.positions, torch.int64).to(dev, non_blocking=True),
            meta=meta,
            logits_indices=list_tensor(out.logits_indices, torch.int64).to(
                dev, non_blocking=True),
            rows=out.sampling, query_lens=query_lens, has_drafts=out.has_drafts,
            placeholder_index=out.placeholder_index, placeholder_row=out.placeholder_row)

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        """A host buffer of num_rows mask rows to fill (reused once its last copy has run)."""
        return self._bitmasks.take(num_rows)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, previous: torch.Tensor | None = None) -> LaunchedStep:
        """Queue the forward pass and the logits. previous: the last step's sampled ids on the
        device, where the placeholder inputs come from (queued after that step's sampling)."""
        with self.times.phase("forward_launch"):
            if inputs.placeholder_index:
                index = list_tensor(inputs.placeholder_index, torch.int64)
                rows = list_tensor(inputs.placeholder_row, torch.int64)
                inputs.input_ids[index.to(self.device, non_blocking=True)] = previous[
                    rows.to(self.device, non_blocking=True)]
            hidden = self._forward(inputs)
            logits = None
            if inputs.logits_indices.numel():
                logits = self.model.compute_logits(hidden[inputs.logits_indices])  # (N, V)
        return LaunchedStep(inputs, logits)

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, masks: StepMasks | None) -> SampledStep:
        """Queue the masked sampling and the copy of its ids to the host (not waited for)."""
        if launched.logits is None:
            return SampledStep(launched.inputs, None)
        bitmask = mask_rows = None
        if masks is not None and masks.bitmask.shape[0]:
            with self.times.phase("mask_upload"):
                bitmask = self._bitmasks.to_device(masks.bitmask)
                mask_rows = list_tensor(masks.mask_rows, torch.int32).to(self.device,
                                                                         non_blocking=True)
        with self.times.phase("sample_launch"):
            samples = sample_on_device(launched.logits, launched.inputs.rows, bitmask,
                                       mask_rows, vocab_size=self.vocab_size)
        return SampledStep(launched.inputs, samples)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The hidden states, from a CUDA graph where one fits."""
        meta = inputs.meta
        num_tokens = inputs.input_ids.shape[0]
        key = None if self.graphs is None else self.graphs.pick(
            meta, num_tokens, has_drafts=inputs.has_drafts)
        if key is not None:
            self.times.count(f"graph_{key[0]}")
            return self.graphs.run(key, inputs.input_ids, inputs.positions, meta,
                                   inputs.query_lens)
        self.times.count("eager")
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    @property
    def max_draft_tokens(self) -> int | None:
        """Drafts per request that keep a verify step inside a CUDA graph (None: no limit)."""
        return None if self.graphs is None else MAX_QUERY_LEN - 1

    def shutdown(self) -> None:
        """Nothing to stop: the runner holds memory only."""
