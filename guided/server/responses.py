"""Response bodies: logprobs in OpenAI's formats, and a job's finished outputs as OpenAI's chat
and completion bodies."""
from __future__ import annotations

from guided.fsm.vocab import gpt2_byte_decoder
from guided.outputs import RequestOutput
from guided.server import protocol as P
from guided.server.jobs import Job, message_out


class TokenTexts:
    """Token id -> its bytes and text, as OpenAI's logprobs show them (cached per id)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_of = gpt2_byte_decoder()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            data = b""
        elif token_id in self._special or not all(c in self._byte_of for c in piece):
            data = self._tokenizer.decode([token_id]).encode("utf-8")
        else:
            data = bytes(self._byte_of[c] for c in piece)
        self._cache[token_id] = data
        return data

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def chat_logprobs(entries, texts: TokenTexts, num_top: int) -> P.ChatLogprobs:
    """`entries`: guided.outputs.TokenLogprob list -> choices[i].logprobs of a chat response."""
    content = []
    for e in entries:
        top = [P.TopLogprob(token=texts.text(t), logprob=lp, bytes=list(texts.bytes(t)))
               for t, lp in e.top[:num_top]]
        content.append(P.ChatTokenLogprob(token=texts.text(e.token_id), logprob=e.logprob,
                                        bytes=list(texts.bytes(e.token_id)), top_logprobs=top))
    return P.ChatLogprobs(content=content)


def completion_logprobs(entries, texts: TokenTexts, num_top: int, offset: int
                        ) -> P.CompletionLogprobs:
    out = P.CompletionLogprobs()
    for e in entries:
        token = texts.text(e.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({texts.text(t): lp for t, lp in e.top[:num_top]})
        out.text_offset.append(offset)
        offset += len(token)
    return out


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
