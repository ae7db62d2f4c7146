"""What the engine hands back: per-request outputs (cumulative, for streaming too) and engine stats."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float = 0.0
    compiled_time: float | None = None  # constraint ready (None: unconstrained)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    forward_passes: int = 0  # model forward passes that computed tokens of this request
    jump_forward_tokens: int = 0  # tokens appended by jump-forward (verified drafts)
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    compile_seconds: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt tokens only)


@dataclass(slots=True)
class RequestOutput:
    """Cumulative state of one request; the server diffs `text` against what it sent before."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None  # finish_reason == "error": what went wrong, for the client
    # "constraint" | "invalid_request" | "internal" | "unavailable" (its engine died: retry)
    error_type: str | None = None
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (vLLM's)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0  # waiting for a grammar or for admission, preempted included
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0  # referenced by live requests; cached-but-free blocks do not count
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens_total: int = 0
    jump_forward_tokens_total: int = 0
    forward_passes_total: int = 0
    preemptions_total: int = 0
    requests_finished_total: dict[str, int] = field(default_factory=dict)  # by finish reason
