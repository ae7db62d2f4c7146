"""Worker processes that build token DFAs' transition tables (fsm/dfa_tables.py) from their
regexes, so that neither serializing an index (~2 ms a MB) nor reading every transition (a
Python dict of each, ~0.1 s a million) holds the engine's GIL: the compile thread that asks
waits on a pipe, without the GIL. A worker builds the index again from the regex (the CPU
work of a second compile, off the engine's process).

A worker (`python -m guided.fsm.table_worker`, fsm/pipe_workers.py) is sent the vocabulary
once, then regexes.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from guided.fsm.dfa_tables import DfaTables, index_tables
from guided.fsm.pipe_workers import PipeWorkers, receive_message, send_message


class TableWorkers(PipeWorkers):
    def __init__(self, num_workers: int, *, eos: int, token_map: dict[bytes, list[int]],
                 num_words: int):
        """eos, token_map: the outlines-core Vocabulary's arguments (fsm/backends/dfa_backend.py
        DfaVocab); num_words: a mask row's int32 words."""
        super().__init__("guided.fsm.table_worker", num_workers,
                         greeting=(eos, token_map, num_words))
        # the threads that wait on the workers: not the compile pool's, whose compiles must
        # never queue behind tables
        self._threads = ThreadPoolExecutor(max(1, num_workers),
                                           thread_name_prefix="guided-dfa-tables")

    def build_later(self, dfa, max_bytes: int) -> Future:
        """dfa.build_tables(max_bytes, self) on a thread of these workers'."""
        return self._threads.submit(dfa.build_tables, max_bytes, self)

    def tables(self, regex: str, max_bytes: int) -> DfaTables | None:
        """The tables of the index of `regex` (None: larger than max_bytes serialized), from an
        idle worker (waits for one)."""
        try:
            ok, result = self.ask((regex, max_bytes))
        except (OSError, EOFError, RuntimeError) as e:
            raise RuntimeError(f"the DFA table worker failed: {e}") from e
        if not ok:
            raise RuntimeError(f"the DFA table worker failed: {result}")
        return result

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        super().shutdown()


def main() -> None:
    import os
    import sys

    import outlines_core as oc

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    os.nice(10)  # never ahead of the engine's step loop for a core
    try:
        eos, token_map, num_words = receive_message(stdin)
    except EOFError:
        return
    vocabulary = oc.Vocabulary(eos, token_map)
    while True:
        try:
            regex, max_bytes = receive_message(stdin)
        except EOFError:
            return
        try:
            index = oc.Index(regex, vocabulary)
            answer = (True, index_tables(index, num_words, eos, max_bytes))
        except Exception as e:  # noqa: BLE001 - reported to the asker, the worker lives on
            answer = (False, repr(e))
        send_message(stdout, answer)


if __name__ == "__main__":
    main()
