"""Worker processes that check JSON schemas and write their regexes (fsm/schema_check.py,
fsm/schema_regex.py, fsm/regex_size.py): the Python stages of a schema's compile, the only ones
that hold the GIL (outlines-core's index and xgrammar's compile run without it;
benchmarks/bench_compile_gil.py --stages). In the engine's process they took ~7 ms of GIL a
schema, in holds of milliseconds, from a step loop that needs it every few microseconds while
a cold server compiles dozens of schemas a second; here the compile thread that asks waits on
a pipe, without the GIL.

A worker is `python -m guided.fsm.schema_worker` (fsm/pipe_workers.py), sent schemas; one
that fails is replaced, and its schema is analysed in the asking thread instead.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from guided.errors import ConstraintError
from guided.fsm.pipe_workers import PipeWorkers, receive_message, send_message

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchemaAnalysis:
    schema: dict  # as check_schema rewrote it
    regex: str | None  # its exact regex; None: not regular (or not asked for)
    size: float  # regex_size(regex) (0 without a regex)


def analyse(value: str, *, want_regex: bool) -> SchemaAnalysis:
    """The schema (JSON text) checked, and its regex and the regex's size where want_regex.
    Raises ConstraintError for a schema the engine refuses."""
    import json

    from guided.fsm.regex_size import regex_size
    from guided.fsm.schema_check import check_schema
    from guided.fsm.schema_regex import NotRegular, schema_regex

    schema = check_schema(json.loads(value))
    regex = None
    if want_regex:
        try:
            regex = schema_regex(schema)
        except NotRegular as e:
            log.debug("json schema on xgrammar: %s", e)
        except Exception as e:  # noqa: BLE001 - a bug here costs the DFA, not the request
            log.warning("json schema on xgrammar: its regex failed: %r", e)
    return SchemaAnalysis(schema, regex, regex_size(regex) if regex is not None else 0.0)


class SchemaWorkers(PipeWorkers):
    def __init__(self, num_workers: int):
        super().__init__("guided.fsm.schema_worker", num_workers)

    def analyse(self, value: str, *, want_regex: bool) -> SchemaAnalysis:
        """analyse() on an idle worker (waits for one); in this thread if the worker fails."""
        try:
            kind, result = self.ask((value, want_regex))
        except (OSError, EOFError, RuntimeError) as e:
            log.warning("a schema worker failed (%s): checking the schema in-process", e)
            return analyse(value, want_regex=want_regex)
        if kind == "ok":
            return result
        if kind == "refused":
            raise ConstraintError(result)
        raise RuntimeError(f"checking the schema failed: {result}")


def main() -> None:
    import os

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    os.nice(10)  # a compile's stage: beside the compile threads, below the step loop
    while True:
        try:
            value, want_regex = receive_message(stdin)
        except EOFError:
            return
        try:
            answer = ("ok", analyse(value, want_regex=want_regex))
        except ConstraintError as e:
            answer = ("refused", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the asker, the worker lives on
            answer = ("failed", repr(e))
        send_message(stdout, answer)


if __name__ == "__main__":  # run as the module's own name: its answers unpickle in the engine
    from guided.fsm.schema_worker import main as worker_main

    worker_main()
