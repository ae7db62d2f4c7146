"""The exceptions that cross module boundaries: each one says what the caller must change."""
from __future__ import annotations


class GuidedError(Exception):
    """Base class of guided's own errors."""


class InvalidRequestError(GuidedError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long, ...): a 400, never a 5xx."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConstraintError(InvalidRequestError):
    """A constraint (schema, regex, grammar, choice) cannot be compiled or enforced."""


class OverloadedError(GuidedError):
    """The engine's waiting queue is full: a 503, the client may retry after retry_after_s."""

    retry_after_s = 1


class CompileTimeoutError(OverloadedError):
    """A constraint did not compile in time, or the compile queue is too deep to start it in
    time: a 503 to retry, never the schema's fault (the compile may still finish in the
    background and fill the cache)."""

    retry_after_s = 5


class EngineDeadError(GuidedError, RuntimeError):
    """The engine cannot run another step (a tensor-parallel worker died): its in-flight
    requests fail with this error, and whoever runs the engine must start a new one (the
    server's engine process exits, and the server starts a fresh one)."""
