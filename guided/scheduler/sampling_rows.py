"""Per sampled row sampling values, as plain data (numpy and lists, no tensors): the sampler's
input, built by the scheduler's side of a step (scheduler/output.py). A row's Gumbel noise is
seeded by (request seed, output position), so a request's tokens depend on its seed and
position only (not on its batch, nor on jump-forward)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from guided.params import SamplingParams

_SPLITMIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                         0x94D049BB133111EB))


def position_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """splitmix64 of each (seed, position), folded to a non-negative int64 (uint64 in): numpy,
    since a verify step at 256 requests seeds ~700 rows."""
    a, b, c = _SPLITMIX
    with np.errstate(over="ignore"):  # uint64 wraps around
        z = seeds * a + positions * b + c
        z = (z ^ (z >> np.uint64(30))) * b
        z = (z ^ (z >> np.uint64(27))) * c
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64((1 << 63) - 1)).astype(np.int64)


@dataclass(slots=True)
class SamplingRows:
    """Per sampled row (one per sampled position) parameters, built by rows_for."""
    temperature: list[float] | np.ndarray
    seeds: list[int] | np.ndarray
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    history: list[list[int]]  # output token ids before each row (penalties)
    prompt_ids: list[list[int]]  # prompt token ids (repetition penalty)
    num_logprobs: list[int]  # -1: none
    needs_slow_path: bool  # the torch path: filters, penalties, logit bias or banned tokens
    logit_bias: list[dict[int, float] | None] | None = None  # (torch path)
    # token ids the row may not sample (EOS and stop tokens before min_tokens; torch path)
    banned: list[tuple[int, ...]] | None = None


@dataclass(slots=True)
class RowSource:
    """A sampled request's part of a step: `count` rows, the first sampling output token
    `first_index`; histories: each row's output tokens before it (penalties only)."""
    params: SamplingParams
    count: int
    seed: int
    first_index: int
    prompt_ids: list[int]
    histories: list[list[int]] | None = None
    stop_ids: tuple[int, ...] = ()  # EOS and stop tokens, banned before params.min_tokens


def rows_for(sources: list[RowSource]) -> SamplingRows:
    """The step's SamplingRows: each request's values repeated over its rows at once (numpy),
    and the torch path's lists filled in only when a request needs them."""
    counts = np.fromiter((s.count for s in sources), np.int64, len(sources))
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    firsts = np.repeat(np.fromiter((s.first_index for s in sources), np.int64, len(sources)),
                       counts)
    seeds = position_seeds(
        np.repeat(np.fromiter((s.seed for s in sources), np.uint64, len(sources)), counts),
        (firsts + np.arange(total) - starts).astype(np.uint64))
    temperature = np.repeat(np.fromiter((s.params.temperature for s in sources), np.float32,
                                        len(sources)), counts)
    num_logprobs = [-1] * total
    if any(s.params.logprobs is not None for s in sources):
        num_logprobs = [-1 if s.params.logprobs is None else s.params.logprobs
                        for s in sources for _ in range(s.count)]
    slow = any(s.params.needs_slow_sampling for s in sources)
    if not slow:  # the fused kernel reads temperatures and seeds only
        return SamplingRows(temperature, seeds, [0] * total, [1.0] * total, [0.0] * total,
                            [0.0] * total, [0.0] * total, [1.0] * total, [[]] * total,
                            [[]] * total, num_logprobs, False)

    def each(field: str) -> list:
        return [getattr(s.params, field) for s in sources for _ in range(s.count)]

    histories = [h for s in sources for h in (s.histories or [[]] * s.count)]
    prompts = [s.prompt_ids for s in sources for _ in range(s.count)]
    banned = [s.stop_ids if s.first_index + j < s.params.min_tokens else ()
              for s in sources for j in range(s.count)]
    return SamplingRows(temperature, seeds, each("top_k"), each("top_p"), each("min_p"),
                        each("presence_penalty"), each("frequency_penalty"),
                        each("repetition_penalty"), histories, prompts, num_logprobs, True,
                        logit_bias=each("logit_bias"), banned=banned)
