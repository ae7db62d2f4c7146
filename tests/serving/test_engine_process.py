"""The engine process's side of the pipe: errors cross it as the classes the server maps to
HTTP statuses (its end to end behaviour: tests/test_engine_client.py)."""
from __future__ import annotations

from guided.serving.engine_process import error_from, error_message
from guided.errors import ConstraintError, InvalidRequestError, OverloadedError
from guided.fsm.schema_check import Unsatisfiable


def test_errors_cross_as_their_nearest_known_class():
    error = error_from(error_message(Unsatisfiable("no value", param="response_format")))
    assert type(error) is ConstraintError and error.param == "response_format"
    assert type(error_from(error_message(InvalidRequestError("bad")))) is InvalidRequestError
    assert type(error_from(error_message(OverloadedError("full")))) is OverloadedError
    assert isinstance(error_from(error_message(KeyError("x"))), RuntimeError)
    assert error_from(None) is None
