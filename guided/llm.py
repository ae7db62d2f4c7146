"""Offline API: LLM(model=..., **config).generate(prompts, params) / .chat(conversations, params)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from guided.config import EngineConfig
from guided.engine.core import Engine
from guided.outputs import RequestOutput
from guided.params import SamplingParams

# the longest generate() waits for a compile while nothing else can step (a compile that ends
# wakes it at once)
COMPILE_POLL_S = 0.05


class LLM:
    def __init__(self, model: str = "default", **config):
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or lists of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # only the finished outputs are read: none made per step, the text decoded once
        params_list = [dataclasses.replace(p, output_kind="final")
                       for p in self._params_per_prompt(params, len(prompts))]
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                outputs = self.engine.step()
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
                if not outputs:
                    self.engine.wait_for_compiles(COMPILE_POLL_S)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return [done[i] for i in ids]

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (a list of messages)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(messages, tools=tools) for messages in conversations]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: Sequence[dict], *, tools: list[dict] | None = None
                            ) -> list[int]:
        out = self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=True,
                                                 add_generation_prompt=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    @staticmethod
    def _params_per_prompt(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
        return list(params)
