"""Turn logits into tokens: the fused mask+sample kernel for plain rows, a torch path for
top-k / top-p / min-p / penalties, both drawing the same seeded Gumbel noise, so a request's
tokens depend on its seed and position only (not on its batch, nor on jump-forward)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from guided.kernels.bitmask import apply_token_bitmask_, gumbel_noise_ref, masked_sample
from guided.kernels.candidates import sample_candidates, scores_candidates
from guided.params import SamplingParams
from guided.worker.host_lists import list_tensor, to_pinned

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), folded to a non-negative int64."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


_SPLITMIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                         0x94D049BB133111EB))


def position_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """position_seed over arrays (uint64 in, int64 out), the same values: a verify step at
    256 requests seeds ~700 rows, ~1 µs each in Python."""
    a, b, c = _SPLITMIX
    with np.errstate(over="ignore"):  # uint64 wraps around, as the & _MASK64 above
        z = seeds * a + positions * b + c
        z = (z ^ (z >> np.uint64(30))) * b
        z = (z ^ (z >> np.uint64(27))) * c
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64((1 << 63) - 1)).astype(np.int64)


@dataclass(slots=True)
class SamplingRows:
    """Per sampled row (one per sampled position) parameters, built on the host (rows_for:
    from each sampled request's parameters and row count)."""

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
    slow: bool | None = None  # needs_slow_path, where the builder knows it

    @property
    def needs_slow_path(self) -> bool:
        if self.slow is not None:
            return self.slow
        return (any(k > 0 for k in self.top_k) or any(p < 1.0 for p in self.top_p)
                or any(p > 0.0 for p in self.min_p) or any(self.presence_penalty)
                or any(self.frequency_penalty) or any(r != 1.0 for r in self.repetition_penalty))


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


def rows_for(sources: list[RowSource]) -> SamplingRows:
    """The step's SamplingRows: each request's values repeated over its rows at once (numpy),
    not appended row by row, and the torch path's lists filled in only when a request needs
    them. A constrained verify step at 256 requests has ~700 rows (benchmarks/bench_prepare.py)."""
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
                            [[]] * total, num_logprobs, slow=False)

    def each(field: str) -> list:
        return [getattr(s.params, field) for s in sources for _ in range(s.count)]

    histories = [h for s in sources for h in (s.histories or [[]] * s.count)]
    prompts = [s.prompt_ids for s in sources for _ in range(s.count)]
    return SamplingRows(temperature, seeds, each("top_k"), each("top_p"), each("min_p"),
                        each("presence_penalty"), each("frequency_penalty"),
                        each("repetition_penalty"), histories, prompts, num_logprobs, slow=True)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (sampled lp, top-k) per row
    # rows sampled unmasked: their best tokens in the sampler's order, the sampled one first
    candidates: dict[int, list[int]] | None = None


def apply_penalties_(logits: torch.Tensor, rows: SamplingRows) -> None:
    """OpenAI presence/frequency penalties over output tokens, and the repetition penalty
    (CTRL: divide positive logits, multiply negative ones) over prompt and output tokens."""
    for i in range(logits.shape[0]):
        pres, freq, rep = (rows.presence_penalty[i], rows.frequency_penalty[i],
                           rows.repetition_penalty[i])
        if pres == 0.0 and freq == 0.0 and rep == 1.0:
            continue
        row = logits[i]
        out_ids = torch.tensor(rows.history[i], dtype=torch.long, device=logits.device)
        if rep != 1.0:
            seen = torch.cat([torch.tensor(rows.prompt_ids[i], dtype=torch.long,
                                           device=logits.device), out_ids]).unique()
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        if out_ids.numel() and (pres or freq):
            counts = torch.bincount(out_ids, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= freq * counts + pres * (counts > 0).to(row.dtype)


def filter_top_k_top_p_min_p_(logits: torch.Tensor, rows: SamplingRows) -> None:
    """In place on temperature-scaled fp32 logits: outside top-k / top-p / min-p -> -inf."""
    for i in range(logits.shape[0]):
        row = logits[i]
        k, p, mp = rows.top_k[i], rows.top_p[i], rows.min_p[i]
        if 0 < k < row.shape[0]:
            kth = torch.topk(row, k).values[-1]
            row[row < kth] = float("-inf")
        if p < 1.0:
            sorted_vals, sorted_idx = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_vals, dim=-1)
            cum = torch.cumsum(probs, dim=-1)
            drop = (cum - probs) > p  # keep the smallest prefix whose mass reaches p
            row[sorted_idx[drop]] = float("-inf")
        if mp > 0.0:
            probs = torch.softmax(row, dim=-1)
            row[probs < mp * probs.max()] = float("-inf")


class DeviceSample:
    """A step's samples still on the device; result() copies them to the host. The copy is
    started at once (pinned buffer, non-blocking) so the host can do other work meanwhile, and
    `token_ids` stays on the device for the next step's inputs (overlapped scheduling)."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: list[int] | None,
                 logprob_values: torch.Tensor | None, num_logprobs: list[int],
                 candidate_rows: list[int] | None = None, candidates: torch.Tensor | None = None):
        self.token_ids = token_ids  # (N,) int64 on the device
        self._logprob_rows = logprob_rows
        self._logprob_values = logprob_values  # (len(rows), V) fp32 log-softmax, on the device
        self._num_logprobs = num_logprobs
        self._candidate_rows = candidate_rows
        self._host, self._host_candidates, self._ready = token_ids, candidates, None
        if token_ids.is_cuda:
            self._host = to_pinned(token_ids)
            if candidates is not None:
                self._host_candidates = to_pinned(candidates)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._host.tolist()
        candidates = None
        if self._candidate_rows:
            candidates = dict(zip(self._candidate_rows, self._host_candidates.tolist()))
        logprobs: list = [None] * len(token_ids)
        if self._logprob_rows:
            lps = self._logprob_values.cpu()
            for j, i in enumerate(self._logprob_rows):
                k = self._num_logprobs[i]
                top = []
                if k > 0:
                    vals, idx = torch.topk(lps[j], k)
                    top = list(zip(idx.tolist(), vals.tolist()))
                logprobs[i] = (float(lps[j][token_ids[i]]), top)
        return SamplerOutput(token_ids, logprobs, candidates)


def sample(logits: torch.Tensor, rows: SamplingRows, bitmask: torch.Tensor | None,
           mask_rows: torch.Tensor | None, **kwargs) -> SamplerOutput:
    """sample_on_device, then its result on the host."""
    return sample_on_device(logits, rows, bitmask, mask_rows, **kwargs).result()


def sample_on_device(logits: torch.Tensor, rows: SamplingRows, bitmask: torch.Tensor | None,
                     mask_rows: torch.Tensor | None, *, vocab_size: int,
                     candidate_rows: list[int] | None = None,
                     num_candidates: int = 0) -> DeviceSample:
    """logits (N, V_logits) on the device; bitmask (M, W) int32 on the device or None;
    mask_rows (N,) int32 row of bitmask per logits row (-1: unconstrained). candidate_rows: rows
    sampled unmasked, whose num_candidates best tokens come back too (kernels/candidates.py)."""
    device = logits.device
    temperature = list_tensor(rows.temperature, torch.float32).to(device, non_blocking=True)
    seeds = list_tensor(rows.seeds, torch.int64).to(device, non_blocking=True)
    wanted = [i for i, k in enumerate(rows.num_logprobs) if k >= 0]
    # log-probabilities of the raw model distribution (as vLLM reports them)
    lps = torch.log_softmax(logits[wanted].float(), dim=-1) if wanted else None
    picked = None
    if candidate_rows and num_candidates:
        picked = list_tensor(candidate_rows, torch.int64).to(device, non_blocking=True)
    candidates = None
    if not rows.needs_slow_path:
        ids = masked_sample(logits, bitmask, mask_rows, temperature, seeds, vocab_size=vocab_size)
        if picked is not None:
            candidates = sample_candidates(logits, picked, temperature, seeds, k=num_candidates,
                                           vocab_size=vocab_size)
    else:
        work = logits.float().clone()  # (N, V)
        apply_penalties_(work, rows)
        if bitmask is not None:
            apply_token_bitmask_(work, bitmask, mask_rows, vocab_size=vocab_size)
        work[:, vocab_size:] = float("-inf")  # padded embedding rows are never tokens
        greedy = temperature <= 1e-5
        scaled = work / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        filter_top_k_top_p_min_p_(scaled, rows)
        noise = gumbel_noise_ref(seeds, work.shape[1])  # (N, V)
        noisy = torch.where(greedy[:, None], work, scaled + noise)
        ids = noisy.argmax(dim=-1)
        if picked is not None:  # penalties already in the scores (no filters: not unmasked)
            candidates = scores_candidates(noisy, picked, k=num_candidates)
    return DeviceSample(ids, wanted, lps, rows.num_logprobs,
                        candidate_rows if picked is not None else None, candidates)
