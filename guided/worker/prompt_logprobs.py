"""Prompt logprobs: the LM head's log-softmax at the prompt positions of the rows that ask for
them (SchedulerOutput.prompt_spans), from the step's hidden states, outside any CUDA graph;
reduced on the device to what is reported (target logprob, rank, top-k) before the host reads."""
from __future__ import annotations

import torch

from guided.scheduler.output import PromptLogprobSpan
from guided.worker.sampler import list_tensor
from guided.worker.step_io import PromptLogprobs

# positions whose logits exist at once: (1024, V) fp32 is 0.5 GB at a 128k vocabulary
MAX_POSITIONS_PER_PASS = 1024


class DevicePromptLogprobs:
    """A step's prompt logprobs, on the device until result()."""

    def __init__(self, spans: list[PromptLogprobSpan], logprobs: torch.Tensor,
                 ranks: torch.Tensor, top_logprobs: torch.Tensor, top_ids: torch.Tensor):
        self.spans = spans
        self.logprobs, self.ranks = logprobs, ranks  # (M,) each, M: the spans' targets
        self.top_logprobs, self.top_ids = top_logprobs, top_ids  # (M, max num_top) each

    def result(self) -> list[PromptLogprobs]:
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_lps, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        out, a = [], 0
        for span in self.spans:
            b, k = a + len(span.target_ids), span.num_top
            out.append(PromptLogprobs(lps[a:b], ranks[a:b], [row[:k] for row in top_ids[a:b]],
                                      [row[:k] for row in top_lps[a:b]]))
            a = b
        return out


def prompt_logprobs(model, hidden: torch.Tensor, spans: list[PromptLogprobSpan]
                    ) -> DevicePromptLogprobs:
    """hidden (T, H): the step's final hidden states. Log-probabilities of the raw model
    distribution over the whole logits width, as the sampler reports output logprobs. At
    tensor parallel size > 1 every rank runs this in step (compute_logits all-gathers)."""
    positions = [t for s in spans for t in range(s.token_start, s.token_start + len(s.target_ids))]
    targets = [t for s in spans for t in s.target_ids]
    num_top = max(s.num_top for s in spans)
    index = list_tensor(positions, torch.int64).to(hidden.device, non_blocking=True)  # (M,)
    target = list_tensor(targets, torch.int64).to(hidden.device, non_blocking=True)  # (M,)
    parts: list[tuple[torch.Tensor, ...]] = []
    for a in range(0, len(positions), MAX_POSITIONS_PER_PASS):
        b = a + MAX_POSITIONS_PER_PASS
        lps = torch.log_softmax(model.compute_logits(hidden[index[a:b]]).float(), dim=-1)
        chosen = lps.gather(1, target[a:b, None])  # (m, 1)
        rank = (lps > chosen).sum(dim=-1) + 1  # (m,)
        top = lps.topk(num_top, dim=-1)  # (m, num_top) each; num_top 0: empty
        parts.append((chosen[:, 0], rank, top.values, top.indices))
    return DevicePromptLogprobs(spans, *(torch.cat(p) for p in zip(*parts)))
