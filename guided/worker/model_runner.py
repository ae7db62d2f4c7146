"""The worker: the model and its KV cache on one device; runs each step it is handed (a
SchedulerOutput, then its StepMasks). It knows no request, grammar or scheduler."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from guided.config import EngineConfig
from guided.scheduler.output import SchedulerOutput
from guided.scheduler.sampling_rows import SamplingRows
from guided.worker import loader
from guided.worker.cuda_graphs import MAX_QUERY_LEN, StepGraphs
from guided.worker.model_config import ModelConfig
from guided.worker.models.llama import AttentionMetadata, build_model
from guided.worker.models.parallel import SINGLE, ParallelContext, rank_device
from guided.worker.models.weights import WeightReader
from guided.worker.prompt_logprobs import DevicePromptLogprobs, prompt_logprobs
from guided.worker.sampler import DeviceSample, list_tensor, sample_on_device, warm_sampling_kernels
from guided.worker.step_io import StepMasks
from guided.worker.step_times import StepTimes
from guided.worker.step_upload import PinnedRing, StepUpload

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache on the CPU, unless num_kv_blocks says otherwise
MIN_MASK_ROWS = 64


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) rows of the packed batch that are sampled
    placeholder_index: torch.Tensor  # (P,) input_ids taking a sampled id of the step in flight
    placeholder_row: torch.Tensor  # (P,) which of its rows


class ModelRunner:
    """One rank's model (its shard, and the KV cache of its KV heads, at world size > 1); the
    logits and samples are whole and equal on every rank. One step is in flight at a time."""

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
        if ctx.world_size > 1:
            self.device = rank_device(self.device.type)
        self.dtype = (getattr(torch, config.dtype) if config.dtype != "auto"
                      else torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.vocab_size = vocab_size  # the tokenizer's: logits columns past it are never sampled
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = build_model(model_config, reader, device=self.device, dtype=self.dtype,
                                 ctx=ctx)
        if self.device.type == "cuda":
            self.model.use_compiled_ops()
        self.num_kv_heads = len(self.model.layout.kv_heads)  # this rank's
        self.num_blocks = self._size_kv_cache()
        cfg = model_config
        # (L, 2, num_blocks + 1, block_size, Hkv, D); the extra block: CUDA graphs' padding.
        # Zeroed on the CPU: the torch reference gathers whole blocks, unwritten slots included
        alloc = torch.zeros if self.device.type == "cpu" else torch.empty
        self.kv_cache = alloc(cfg.num_layers, 2, self.num_blocks + 1, self.block_size,
                              self.num_kv_heads, cfg.head_dim, dtype=self.dtype,
                              device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.mask_words = -(-vocab_size // 32)
        self._masks = PinnedRing(self.device, torch.int32, self.mask_words,
                                 min_rows=MIN_MASK_ROWS)
        self._upload = StepUpload(self.device)
        self.use_triton = self.device.type == "cuda"
        self.graphs = None
        if self.use_triton and config.cuda_graphs:
            # at world size > 1 every rank captures the same graphs (and all-reduces) in order
            self.graphs = StepGraphs(
                self.model, self.kv_caches, max_batch=min(config.max_num_seqs, 512),
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                block_size=self.block_size, scratch_block=self.num_blocks, device=self.device,
                max_step_tokens=config.max_num_batched_tokens)
        if self.use_triton:
            warm_sampling_kernels(model_config.vocab_size, vocab_size=vocab_size,
                                  dtype=self.dtype, device=self.device)
        # rows, logits, prompt logprobs
        self._launched: tuple[SamplingRows, torch.Tensor | None,
                              DevicePromptLogprobs | None] | None = None
        self._last_sampled: DeviceSample | None = None  # its ids feed the next placeholders

    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def _size_kv_cache(self) -> int:
        """The blocks every rank has room for (a block id means the same tokens on each rank);
        every rank takes part, even one without room, so none waits for a rank that gave up."""
        per_block = self.kv_bytes_per_block()
        if self.config.num_kv_blocks is not None:
            num = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            # gpu_memory_utilization: this engine's share of the GPU, weights included (vLLM's)
            free, total = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            reserve = (self.config.max_num_batched_tokens
                       * (self.model_config.vocab_size * 4 + self.model_config.intermediate_size
                          * 8)) + (1 << 30)  # activations, logits, CUDA graphs
            budget = min(total * self.config.gpu_memory_utilization - weights, free) - reserve
            num = max(int(budget // per_block), 0)
        else:
            num = CPU_KV_CACHE_BYTES // per_block
        if self.ctx.world_size > 1:
            num = self.ctx.all_min(num)
        if num < 2:
            raise MemoryError(f"no room for the KV cache ({num} blocks of "
                              f"{per_block / 2**20:.1f} MiB on some rank)")
        return num

    @property
    def max_draft_tokens(self) -> int | None:
        """Drafts per request that keep a verify step in a CUDA graph (None: no limit)."""
        return None if self.graphs is None else MAX_QUERY_LEN - 1

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        arrays = [np.array(values, dtype=dtype) for values, dtype in (
            (out.input_ids, np.int64), (out.positions, np.int64),
            (out.logits_indices, np.int64), (out.slot_mapping, np.int64),
            (out.block_tables, np.int32), (out.query_start_loc, np.int32),
            (out.seq_lens, np.int32), (out.placeholder_index, np.int64),
            (out.placeholder_row, np.int64))]
        (input_ids, positions, logits_indices, slot_mapping, block_tables, query_start_loc,
         seq_lens, placeholder_index, placeholder_row) = self._upload.upload(arrays)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables,
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            max_query_len=max(out.query_lens), max_seq_len=max(out.seq_lens),
            use_triton=self.use_triton)
        return StepInputs(input_ids, positions, meta, logits_indices, placeholder_index,
                          placeholder_row)

    def launch(self, out: SchedulerOutput) -> None:
        """Queue the forward pass and logits; placeholder inputs are the last sampled ids."""
        if self._launched is not None:
            raise RuntimeError("a step is launched and not sampled yet")
        with self.times.phase("prepare"):
            inputs = self.prepare(out)
        with torch.inference_mode(), self.times.phase("forward_launch"):
            if out.placeholder_index:
                inputs.input_ids[inputs.placeholder_index] = (
                    self._last_sampled.token_ids[inputs.placeholder_row])
            hidden = self._forward(inputs, has_drafts=out.has_drafts)
            logits = None
            if out.logits_indices:
                logits = self.model.compute_logits(hidden[inputs.logits_indices])  # (N, V)
            prompt = prompt_logprobs(self.model, hidden, out.prompt_spans) \
                if out.prompt_spans else None
        self._launched = (out.sampling, logits, prompt)

    def _forward(self, inputs: StepInputs, *, has_drafts: bool) -> torch.Tensor:
        meta, num_tokens = inputs.meta, inputs.input_ids.shape[0]
        key = None if self.graphs is None else self.graphs.pick(meta, num_tokens,
                                                                has_drafts=has_drafts)
        if key is not None:
            self.times.count(f"graph_{key[0]}")
            return self.graphs.run(key, inputs.input_ids, inputs.positions, meta)
        self.times.count("eager")
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 (num_rows, mask_words) host buffer to fill (old contents: garbage)."""
        return self._masks.take(num_rows)

    @torch.inference_mode()
    def sample(self, masks: StepMasks | None) -> DeviceSample:
        if self._launched is None:
            raise RuntimeError("nothing launched to sample")
        (rows, logits, prompt), self._launched = self._launched, None
        if logits is None:  # no row samples this step
            self._last_sampled = DeviceSample(torch.empty(0, dtype=torch.int64), [], None, [])
        else:
            bitmask = mask_rows = None
            if masks is not None and masks.bitmask.shape[0]:
                with self.times.phase("mask_upload"):
                    bitmask = self._masks.to_device(masks.bitmask)
                    mask_rows = list_tensor(masks.mask_rows, torch.int32)
                    mask_rows = mask_rows.to(self.device, non_blocking=True)
            with self.times.phase("sample_launch"):
                self._last_sampled = sample_on_device(logits, rows, bitmask, mask_rows,
                                                      vocab_size=self.vocab_size)
        self._last_sampled.prompt_logprobs = prompt
        return self._last_sampled

    def forget(self) -> None:
        self._launched = self._last_sampled = None


def make_executor(config: EngineConfig, model_config: ModelConfig, *, vocab_size: int,
                  step_times: StepTimes):
    if config.tensor_parallel_size == 1:
        reader = loader.weight_reader(config.model, config.seed)
        return LocalExecutor(ModelRunner(config, model_config, reader, vocab_size=vocab_size,
                                         step_times=step_times))
    from guided.worker.multiproc import MultiprocExecutor  # it imports this module

    return MultiprocExecutor(config, model_config, vocab_size=vocab_size, step_times=step_times)


class LocalExecutor:
    """tensor_parallel_size 1: the runner in the engine's process. MultiprocExecutor takes the
    same calls to one process per rank."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.num_blocks, self.max_model_len = runner.num_blocks, runner.max_model_len
        self.max_draft_tokens = runner.max_draft_tokens
        self.device, self.dtype = str(runner.device), str(runner.dtype).removeprefix("torch.")

    def launch(self, out: SchedulerOutput) -> None:
        self.runner.launch(out)

    def new_bitmask(self, num_rows: int) -> torch.Tensor:
        return self.runner.new_bitmask(num_rows)

    def sample(self, masks: StepMasks | None) -> DeviceSample:
        return self.runner.sample(masks)

    def forget(self) -> None:
        self.runner.forget()

    def shutdown(self) -> None:
        """Nothing to stop: the runner holds memory only."""
