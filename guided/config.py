"""One frozen EngineConfig: what a user sets, validated once with errors that say what to change."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from guided.errors import InvalidRequestError

DEFAULT_MODEL = "default"


def _option(default, help_text: str):
    """A field with its one-line help (what `guided serve --help` prints)."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What a user sets; everything else is a constant of its module or derived from the host
    once (fsm/settings.py CompileSettings.for_host, worker/model_runner.py resolve_device)."""

    model: str = _option(DEFAULT_MODEL, '"default" (the embedded SmolLM2-135M-Instruct), an HF '
                         "model directory, a .gguf file, or synthetic:<shape> (random weights)")
    device: str = _option("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = _option("auto", "auto (float32 on a CPU, bfloat16 on a GPU) | float32 | "
                                 "bfloat16 | float16")
    seed: int = _option(0, "seeds random weights and the sampling of requests that bring none")

    # KV cache and batching
    block_size: int = _option(16, "tokens per KV cache block (8, 16, 32, 64 or 128)")
    num_kv_blocks: int | None = _option(None, "KV cache blocks (None: sized from memory)")
    gpu_memory_utilization: float = _option(0.85, "this engine's share of the GPU's memory "
                                                  "(weights, activations, KV cache), as in vLLM")
    max_model_len: int | None = _option(None, "longest prompt + output (None: the model's "
                                              "context length)")
    max_num_seqs: int = _option(256, "requests running at once")
    max_num_batched_tokens: int = _option(2048, "tokens per step: prefill chunks, decodes, "
                                                "drafts")
    enable_prefix_caching: bool = _option(True, "share the KV blocks of common prompt prefixes")
    max_waiting_requests: int = _option(4096, "requests in flight beyond which new ones are "
                                              "refused as overloaded")

    # structured generation
    jump_forward: bool = _option(True, "verify the grammar's forced text as draft tokens: the "
                                       "same outputs in fewer forward passes")
    any_whitespace: bool = _option(False, "let JSON output hold any whitespace (default: "
                                          "compact separators)")
    compile_timeout_s: float = _option(30.0, "seconds a constraint may take to compile")

    # execution
    tensor_parallel_size: int = _option(1, "GPUs (or CPU ranks) the model is split over, one "
                                           "worker process each (1: the worker in-process)")
    cuda_graphs: bool = _option(True, "replay decode and verify steps as CUDA graphs (off: "
                                      "eager, as vLLM's --enforce-eager)")
    async_scheduling: bool | None = _option(
        None, "overlap the host's work for a step with the device's forward pass of the one "
              "before (None: on where the model runs on a GPU)")
    log_stats_interval_s: float = _option(10.0, "seconds between the server's progress logs "
                                                "while it has work (0: never)")

    def __post_init__(self) -> None:
        def need(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        need(self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128",
             "block_size")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
             "num_kv_blocks must be at least 2 (or None to size it from memory)", "num_kv_blocks")
        need(0.05 <= self.gpu_memory_utilization <= 0.99,
             "gpu_memory_utilization must lie in [0.05, 0.99]", "gpu_memory_utilization")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1", "max_num_seqs")
        need(self.max_num_batched_tokens >= 16, "max_num_batched_tokens must be >= 16",
             "max_num_batched_tokens")
        need(self.max_model_len is None or self.max_model_len >= 16,
             "max_model_len must be >= 16", "max_model_len")
        need(self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1",
             "max_waiting_requests")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             "dtype must be auto, float32, bfloat16 or float16", "dtype")
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
             "device must be auto, cpu or cuda[:N]", "device")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1",
             "tensor_parallel_size")
        need(self.tensor_parallel_size == 1 or not self.device.startswith("cuda:"),
             "with tensor_parallel_size > 1 rank r runs on cuda:r: pick the GPUs with "
             "CUDA_VISIBLE_DEVICES instead of device=cuda:N", "device")
        need(self.compile_timeout_s > 0, "compile_timeout_s must be > 0", "compile_timeout_s")
        need(self.log_stats_interval_s >= 0, "log_stats_interval_s must be >= 0",
             "log_stats_interval_s")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; known: {sorted(names)}", param=unknown[0])
        return cls(**kwargs)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
