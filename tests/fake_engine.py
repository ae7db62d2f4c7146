"""A model-free stand-in for guided.engine.core.Engine (same API) for fast server and async tests.

The output of a request is scripted by its prompt: the text after the last "ECHO:" (up to the
next "<|im_end|>") is emitted one byte-token per step. "RAISE" makes step() raise; "DEAD" raise
EngineDeadError (as a dead tensor-parallel worker does); "SLOW" emits
nothing for a long time (a request that never finishes on its own); "BUSY" computes for BUSY_S in
its first step (a CPU host's long prefill), then echoes itself.

fake_client() runs one in an engine process behind an EngineClient, as `guided serve` runs the
real engine (tests/ is on sys.path, so the spawned process imports this module by name)."""
from __future__ import annotations

import concurrent.futures
import functools
import re
import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from guided.config import EngineConfig
from guided.errors import ConstraintError, EngineDeadError, InvalidRequestError, OverloadedError
from guided.fsm.vocab import gpt2_byte_decoder
from guided.outputs import EngineStats, RequestMetrics, RequestOutput, TokenLogprob
from guided.params import ConstraintSpec, SamplingParams
from guided.serving.client import EngineClient

BUSY_S = 8.0
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (ids 3..258) after <|endoftext|>, <|im_start|>, <|im_end|> (0, 1, 2)."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c, b in sorted(gpt2_byte_decoder().items(), key=lambda item: item[1]):
        vocab[c] = 3 + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


class FakeCompiler:
    def __init__(self):
        self.submitted: list[ConstraintSpec] = []

    def submit(self, spec: ConstraintSpec) -> concurrent.futures.Future:
        self.submitted.append(spec)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            if spec.kind == "regex":
                re.compile(spec.value)
            if spec.kind == "json_schema" and '"nonsense"' in spec.value:
                raise ValueError("unknown type 'nonsense'")
            if spec.kind == "grammar" and "::=" not in spec.value:
                raise ValueError("no rule")
            future.set_result(("compiled", spec))
        except (ValueError, re.error) as e:
            future.set_exception(ConstraintError(f"{spec.kind}: {e}"))
        return future


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    script: list[int]
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None


class FakeEngine:
    def __init__(self, max_model_len: int = 512, max_waiting: int = 64):
        self.config = EngineConfig(max_waiting_requests=max_waiting)
        self.tokenizer = byte_tokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(self.tokenizer)
        self.compiler = FakeCompiler()
        self._reqs: dict[str, _Req] = {}
        self._finished: dict[str, int] = {}
        self._generated = 0
        self._prompt_tokens = 0

    def add_request(self, request_id: str, prompt, params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt too long", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError("token id outside the vocabulary", param="prompt")
        if len(self._reqs) >= self.config.max_waiting_requests:
            raise OverloadedError("queue full")
        text = self.tokenizer.decode(ids)
        script = text.rsplit("ECHO:", 1)[-1].split("<|im_end|>")[0] if "ECHO:" in text else "ok"
        self._reqs[request_id] = _Req(request_id, ids, params,
                                      self.tokenizer.encode(script, add_special_tokens=False),
                                      arrival_time or time.time())
        self._prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        if self._reqs.pop(request_id, None) is not None:
            self._finished["abort"] = self._finished.get("abort", 0) + 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[RequestOutput]:
        outs = []
        for r in list(self._reqs.values()):
            script_text = self.tokenizer.decode(r.script)
            if script_text == "RAISE":
                raise RuntimeError("boom")
            if script_text == "DEAD":
                raise EngineDeadError("tensor-parallel worker lost: rank 1 exited by signal 9")
            if script_text == "SLOW":
                time.sleep(0.01)
                continue
            if script_text == "BUSY" and not r.token_ids:
                end = time.monotonic() + BUSY_S
                while time.monotonic() < end:
                    pass
            r.token_ids.append(r.script[len(r.token_ids)])
            r.first_token_time = r.first_token_time or time.time()
            self._generated += 1
            reason = None
            if len(r.token_ids) == len(r.script):
                reason = "stop"
            elif r.params.max_tokens is not None and len(r.token_ids) >= r.params.max_tokens:
                reason = "length"
            if reason:
                del self._reqs[r.request_id]
                self._finished[reason] = self._finished.get(reason, 0) + 1
            logprobs = None
            if r.params.logprobs is not None:
                logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), (3, -2.0)][:r.params.logprobs])
                            for t in r.token_ids]
            now = time.time()
            outs.append(RequestOutput(
                request_id=r.request_id, prompt_token_ids=r.prompt_ids,
                token_ids=r.token_ids, text=self.tokenizer.decode(r.token_ids),
                finished=reason is not None, finish_reason=reason, logprobs=logprobs,
                metrics=RequestMetrics(arrival_time=r.arrival, first_token_time=r.first_token_time,
                                       finished_time=now if reason else None)))
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._reqs), kv_blocks_total=64,
                           kv_blocks_in_use=len(self._reqs), prompt_tokens_total=self._prompt_tokens,
                           generation_tokens_total=self._generated,
                           requests_finished_total=dict(self._finished))


def fake_client(**kwargs) -> EngineClient:
    """An EngineClient whose engine process runs FakeEngine(**kwargs)."""
    build = functools.partial(FakeEngine, **kwargs)
    return EngineClient(None, log_level="warning", build_engine=build)
