"""A row's sampled tokens appended to their request: the grammar's accepts, the output ids, the
text, and where the request finishes. A constrained step at 256 requests appends ~700 tokens
(jump-forward rows carry several), so the text is decoded once per row, not once per token;
a request with stop strings goes token by token, to cut its output at the one that stops."""
from __future__ import annotations

from dataclasses import dataclass

from guided.engine.detokenizer import Decode, detokenize_rest, detokenize_step, find_stop
from guided.outputs import TokenLogprob
from guided.scheduler.output import RowMap
from guided.scheduler.request import Request
from guided.scheduler.scheduler import StepPlan
from guided.worker.step_io import PromptLogprobs


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop", "length" or "error"
    stop_reason: int | str | None = None  # the stop token or stop string
    error: str | None = None


def append_tokens(request: Request, tokens: list[int], logprobs: list | None, *,
                  decode: Decode, max_model_len: int, decode_at_finish: bool = True
                  ) -> tuple[int, Finish | None]:
    """Appends tokens (in order, up to where the request finishes) to the request; returns
    how many were appended and the finish, if any. Each token is fed to the request's matcher
    first; one it rejects ends the request with an internal error, unappended. decode_at_finish
    off: a request that wants only its final output is left to the caller to decode
    (detokenize_final), at a time of its choosing."""
    if request.params.stop_list and len(tokens) > 1:
        total = 0
        for j, token in enumerate(tokens):
            n, finish = append_tokens(request, [token], None if logprobs is None
                                      else logprobs[j:j + 1], decode=decode,
                                      max_model_len=max_model_len,
                                      decode_at_finish=decode_at_finish)
            total += n
            if finish is not None:
                return total, finish
        return total, None
    params, matcher = request.params, request.matcher
    stop_ids = params.stop_token_ids or ()
    room = min(request.max_tokens - len(request.output_token_ids),
               max_model_len - request.num_tokens)
    if room <= 0:  # max_tokens 0: its prompt ran for its logprobs alone
        return 0, Finish("length")
    n = 0
    finish = None
    on_stop_token = False
    for token in tokens:
        if matcher is not None and not matcher.accept_token(token):
            finish = Finish("error", error=f"the grammar rejected sampled token {token}")
            break
        n += 1
        if token in request.eos_token_ids or token in stop_ids:
            finish, on_stop_token = Finish("stop", token), True
            break
        if matcher is not None and matcher.ended_with(token):
            finish = Finish("stop")
            break
        if n >= room:
            finish = Finish("length")
            break
    # text_per_step off: the text waits for the finish, decoded at once (detokenize_rest)
    per_step = params.text_per_step
    if not n:
        if finish is not None and not per_step and decode_at_finish:
            detokenize_rest(decode, request, params.skip_special_tokens)
        return 0, finish
    new = tokens[:n]
    output = request.output_token_ids
    if request.logprobs is not None and logprobs is not None:
        request.logprobs.extend(TokenLogprob(t, lp[0], lp[1])
                                for t, lp in zip(new, logprobs) if lp is not None)
    # a stop token is kept in the ids but never decoded into the text
    output.extend(new[:-1] if on_stop_token else new)
    if not per_step:
        if finish is not None and decode_at_finish:  # before a stop token joins the ids
            detokenize_rest(decode, request, params.skip_special_tokens)
    elif not on_stop_token or n > 1:
        checked = len(request.text)
        detokenize_step(decode, request, params.skip_special_tokens)
        if params.stop_list and len(output) >= params.min_tokens:  # vLLM's rule
            hit = find_stop(request.text, params.stop_list, checked)
            if hit is not None:
                end = hit[0] + (len(hit[1]) if params.include_stop_str_in_output else 0)
                request.text = request.text[:end]
                finish = Finish("stop", hit[1])
    if on_stop_token:
        output.append(new[-1])
    return n, finish


def append_prompt_logprobs(plan: StepPlan, rows: RowMap, spans: list[PromptLogprobs]) -> None:
    """A step's prompt logprobs, each span's onto its request from prompt position
    rows.prompt_first on; positions a request holds already (a chunk recomputed after a
    preemption) keep their entries."""
    for owner, first, span in zip(rows.prompt_owner, rows.prompt_first, spans):
        request = plan.scheduled[owner].request
        held, prompt = request.prompt_logprobs, request.prompt_token_ids
        if held is None or first > len(held):
            continue
        for j in range(len(held) - first, len(span.logprobs)):
            held.append(TokenLogprob(prompt[first + j], span.logprobs[j],
                                     list(zip(span.top_ids[j], span.top_logprobs[j])),
                                     rank=span.ranks[j]))
