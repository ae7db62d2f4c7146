"""Logits to tokens: the fused mask+sample kernel for plain rows, a torch path for top-k /
top-p / min-p / penalties, both with the same seeded Gumbel noise, so a request's tokens depend
on its seed and position only (not on its batch, nor on jump-forward)."""
from __future__ import annotations

import numpy as np
import torch

from guided.kernels.bitmask import apply_token_bitmask_, gumbel_noise_ref, masked_sample
from guided.scheduler.sampling_rows import SamplingRows
from guided.worker.step_io import RunnerOutput

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def list_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) at a third of the cost for long lists (numpy converts
    Python numbers without torch's per-element dispatch)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


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


def apply_logit_bias_(logits: torch.Tensor, rows: SamplingRows) -> None:
    """OpenAI's logit_bias (ids past the logits' width are not tokens of this model: skipped)."""
    for i, bias in enumerate(rows.logit_bias or ()):
        if bias:
            ids = [t for t in bias if t < logits.shape[1]]
            if ids:
                logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype,
                                               device=logits.device)


def ban_stops_(logits: torch.Tensor, rows: SamplingRows) -> None:
    """min_tokens: a row before it may not sample EOS or a stop token, unless they are all its
    grammar allows (the constraint wins: the row is left as it was)."""
    for i, ids in enumerate(rows.banned or ()):
        if ids:
            saved = logits[i, list(ids)].clone()
            logits[i, list(ids)] = float("-inf")
            if torch.isinf(logits[i]).all():
                logits[i, list(ids)] = saved


def filter_top_k_top_p_min_p_(logits: torch.Tensor, rows: SamplingRows) -> None:
    """In place on temperature-scaled fp32 logits."""
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
    """A step's samples, their copy to the host started at once; result() waits for it.
    token_ids stays on the device for the next step's placeholder inputs."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: list[int],
                 logprob_values: torch.Tensor | None, num_logprobs: list[int]):
        self.token_ids = token_ids  # (N,) int64 on the device
        self._logprob_rows = logprob_rows
        self._logprob_values = logprob_values  # (len(rows), V) fp32 log-softmax, on the device
        self._num_logprobs = num_logprobs
        self.prompt_logprobs = None  # the step's DevicePromptLogprobs, if it computed any
        self._host, self._ready = token_ids, None
        if token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> RunnerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        token_ids = self._host.tolist()
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
        prompt = self.prompt_logprobs
        return RunnerOutput(token_ids, logprobs, [] if prompt is None else prompt.result())


def warm_sampling_kernels(num_cols: int, *, vocab_size: int, dtype: torch.dtype,
                          device: torch.device) -> None:
    """Compile every variant of the sampling kernels now, for logits of num_cols columns: with
    and without a bitmask, one vocab split and several, the slow path's float32 mask. A variant
    first met mid-run compiles inside that step, stalling every request in it."""
    words = -(-vocab_size // 32)
    logits = torch.zeros(2, num_cols, dtype=dtype, device=device)
    bitmask = torch.full((2, words), -1, dtype=torch.int32, device=device)
    mask_rows = torch.zeros(2, dtype=torch.int32, device=device)
    temperature = torch.ones(2, dtype=torch.float32, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    for mask, rows in ((None, None), (bitmask, mask_rows)):
        for num_splits in (1, 2):
            masked_sample(logits, mask, rows, temperature, seeds, vocab_size=vocab_size,
                          num_splits=num_splits)
    apply_token_bitmask_(logits.float(), bitmask, mask_rows, vocab_size=vocab_size)


def sample_on_device(logits: torch.Tensor, rows: SamplingRows, bitmask: torch.Tensor | None,
                     mask_rows: torch.Tensor | None, *, vocab_size: int) -> DeviceSample:
    """logits (N, V_logits) on the device; bitmask (M, W) int32 on the device or None;
    mask_rows (N,) int32 row of bitmask per logits row (-1: unconstrained)."""
    device = logits.device
    temperature = list_tensor(rows.temperature, torch.float32).to(device, non_blocking=True)
    seeds = list_tensor(rows.seeds, torch.int64).to(device, non_blocking=True)
    wanted = [i for i, k in enumerate(rows.num_logprobs) if k >= 0]
    # log-probabilities of the raw model distribution (as vLLM reports them)
    lps = torch.log_softmax(logits[wanted].float(), dim=-1) if wanted else None
    if not rows.needs_slow_path:
        ids = masked_sample(logits, bitmask, mask_rows, temperature, seeds, vocab_size=vocab_size)
    else:
        work = logits.float().clone()  # (N, V)
        apply_penalties_(work, rows)
        apply_logit_bias_(work, rows)
        if bitmask is not None:
            apply_token_bitmask_(work, bitmask, mask_rows, vocab_size=vocab_size)
        ban_stops_(work, rows)
        work[:, vocab_size:] = float("-inf")  # padded embedding rows are never tokens
        greedy = temperature <= 1e-5
        scaled = work / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
        filter_top_k_top_p_min_p_(scaled, rows)
        noise = gumbel_noise_ref(seeds, work.shape[1])  # (N, V)
        noisy = torch.where(greedy[:, None], work, scaled + noise)
        ids = noisy.argmax(dim=-1)
    return DeviceSample(ids, wanted, lps, rows.num_logprobs)
