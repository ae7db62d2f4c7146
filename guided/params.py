"""SamplingParams (vLLM's field names) and the constraint spec they carry."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from guided.errors import ConstraintError, InvalidRequestError

MAX_SEED = 1 << 63
MAX_LOGIT_BIAS = 300  # as OpenAI's API
MAX_STOP_TOKEN_IDS = 1024  # each sampled token is looked up among them

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar",
                         "structural_tag"]


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """A constraint normalized to a hashable cache key: `value` is canonical text for its kind
    (compact JSON for a schema, keeping the client's property order, which the output follows;
    a JSON list for choices; the pattern or grammar verbatim)."""

    kind: ConstraintKind
    value: str

    @staticmethod
    def json_schema(schema: dict | str | bool) -> "ConstraintSpec":
        return ConstraintSpec("json_schema", _json_text("json_schema", schema, (dict, bool)))

    @staticmethod
    def choice(options: list[str]) -> "ConstraintSpec":
        if not isinstance(options, (list, tuple)) or not options:
            raise ConstraintError("choice must be a non-empty list of strings")
        if not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("every choice must be a non-empty string")
        return ConstraintSpec("choice", json.dumps(list(options), ensure_ascii=False))

    @staticmethod
    def structural_tag(tag: dict | str) -> "ConstraintSpec":
        """Free text until a trigger opens a tag whose content follows its schema."""
        return ConstraintSpec("structural_tag", _json_text("structural_tag", tag, (dict,)))

    def schema(self) -> Any:
        return json.loads(self.value) if self.kind == "json_schema" else None


def _json_text(kind: str, value, types: tuple) -> str:
    """Compact JSON of a parsed or textual value (keeping the client's key order)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"{kind} is not valid JSON: {e}") from None
    if not isinstance(value, types):
        raise ConstraintError(f"{kind} must be a JSON object"
                              + (" (or a boolean schema)" if bool in types else ""))
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    # vLLM's: per prompt token (the first has none) its logprob and rank, and this many top ones
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: token id -> bias added to its logit, in [-100, 100]
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # EOS, stop tokens and stop strings ignored before this many tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ends it kept
    n: int = 1
    # the constraint: at most one of these
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None  # vLLM's / SGLang's (fsm/structural_tags.py)
    # "cumulative": an output at every step that moves the request on (streaming); "final":
    # only the finished one, its text decoded once at the end, not token by token (vLLM's
    # FINAL_ONLY: the offline API and non-streaming requests, the step loop's host work smaller)
    output_kind: str = "cumulative"
    stop_list: list[str] = field(init=False, default_factory=list)

    @property
    def filters_tokens(self) -> bool:
        """top-k / top-p / min-p: the distribution is cut before sampling."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def needs_slow_sampling(self) -> bool:
        """top-k / top-p / min-p or a penalty: the sampler's torch path, not the fused kernel."""
        return (self.filters_tokens or bool(self.presence_penalty or self.frequency_penalty)
                or self.repetition_penalty != 1.0 or bool(self.logit_bias)
                or self.min_tokens > 0)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 0),
             "max_tokens must be a non-negative integer", "max_tokens")
        need(0.0 <= self.temperature <= 100.0, "temperature must lie in [0, 100]", "temperature")
        need(0.0 < self.top_p <= 1.0, "top_p must lie in (0, 1]", "top_p")
        need(isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1 (off) or >= 0",
             "top_k")
        need(0.0 <= self.min_p <= 1.0, "min_p must lie in [0, 1]", "min_p")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must lie in [-2, 2]",
             "presence_penalty")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must lie in [-2, 2]",
             "frequency_penalty")
        need(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must lie in (0, 10]",
             "repetition_penalty")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must lie in [0, 20]",
             "logprobs")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs must be an integer in [0, 20]", "prompt_logprobs")
        need(isinstance(self.n, int) and 1 <= self.n <= 16, "n must lie in [1, 16]", "n")
        # the sampler keys its noise on a uint64 and the engine's own seeds are 63 bits: a
        # seed outside [0, 2**63) used to raise inside a step and fail the whole batch
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < MAX_SEED),
             f"seed must be an integer in [0, {MAX_SEED - 1}]", "seed")
        need(self.stop_token_ids is None or (
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
            and all(isinstance(t, int) for t in self.stop_token_ids)),
             f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} integers",
             "stop_token_ids")
        need(self.logit_bias is None or (
            isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(isinstance(k, int) and k >= 0 and isinstance(v, (int, float))
                    and -100.0 <= v <= 100.0 for k, v in self.logit_bias.items())),
             f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
             "logit_bias")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0
             and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
             "min_tokens must be an integer in [0, max_tokens]", "min_tokens")
        need(self.output_kind in ("cumulative", "final"),
             "output_kind must be 'cumulative' or 'final'", "output_kind")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        need(all(isinstance(s, str) for s in stops) and len(stops) <= 16,
             "stop must be a string or a list of at most 16 strings", "stop")
        self.stop_list = [s for s in stops if s]
        set_constraints = [name for name, on in (
            ("json_schema", self.json_schema is not None), ("json_object", bool(self.json_object)),
            ("regex", self.regex is not None), ("choice", self.choice is not None),
            ("grammar", self.grammar is not None),
            ("structural_tag", self.structural_tag is not None)) if on]
        need(len(set_constraints) <= 1,
             f"at most one constraint per request, got {set_constraints}", set_constraints[-1]
             if set_constraints else "json_schema")

    @property
    def constraint(self) -> ConstraintSpec | None:
        if self.json_schema is not None:
            return ConstraintSpec.json_schema(self.json_schema)
        if self.json_object:
            return ConstraintSpec("json_object", "")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ConstraintError("regex must be a non-empty string")
            return ConstraintSpec("regex", self.regex)
        if self.choice is not None:
            return ConstraintSpec.choice(self.choice)
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ConstraintError("grammar must be a non-empty EBNF string")
            return ConstraintSpec("grammar", self.grammar)
        if self.structural_tag is not None:
            return ConstraintSpec.structural_tag(self.structural_tag)
        return None

    @property
    def text_per_step(self) -> bool:
        """Whether the text is decoded as tokens arrive: for the outputs of every step, or
        for stop strings, which are searched for in it."""
        return self.output_kind == "cumulative" or bool(self.stop_list)

    @property
    def runs_model(self) -> bool:
        """Whether the model runs for it: it generates, or its prompt's logprobs are asked for
        (max_tokens 0 then scores the prompt alone, as OpenAI's echo did)."""
        return self.max_tokens != 0 or self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
