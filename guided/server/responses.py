"""Non-streamed responses: a job's finished outputs as OpenAI's chat and completion bodies."""
from __future__ import annotations

from guided.outputs import RequestOutput
from guided.server import protocol as P
from guided.server.jobs import Job, message_out
from guided.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs


def usage(job: Job, outs: list[RequestOutput]) -> P.UsageInfo:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(o.token_ids) for o in outs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)


def chat_response(job: Job, outs: list[RequestOutput], texts: TokenTexts
                  ) -> P.ChatCompletionResponse:
    choices = []
    for i, out in enumerate(outs):
        message, reason = message_out(job.plan, out, reasoning=job.reasoning)
        logprobs = chat_logprobs(out.logprobs or [], texts, job.num_top) \
            if job.params[i].logprobs is not None else None
        choices.append(P.ChatChoice(index=i, message=message, logprobs=logprobs,
                                    finish_reason=reason))
    return P.ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                    usage=usage(job, outs))


def completion_response(job: Job, outs: list[RequestOutput], texts: TokenTexts, *, echo: bool
                        ) -> P.CompletionResponse:
    choices = []
    for i, out in enumerate(outs):
        prefix = job.echo[job.prompt_of[i]] if echo else ""
        logprobs = completion_logprobs(out.logprobs or [], texts, job.num_top, len(prefix)) \
            if job.params[i].logprobs is not None else None
        choices.append(P.CompletionChoice(index=i, text=prefix + out.text, logprobs=logprobs,
                                          finish_reason=out.finish_reason))
    return P.CompletionResponse(id=job.request_id, model=job.model, choices=choices,
                                usage=usage(job, outs))
