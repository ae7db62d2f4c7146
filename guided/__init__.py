"""guided: structured generation (JSON schema, regex, choice, grammar, tools) served fast."""
from guided.config import EngineConfig
from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.outputs import RequestOutput
from guided.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "ConstraintError",
           "InvalidRequestError", "OverloadedError"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it only when asked for
    if name == "LLM":
        from guided.llm import LLM

        return LLM
    raise AttributeError(name)
