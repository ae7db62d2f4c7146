"""Asynchronous grammar compilation: an LRU of futures in front of a watchdog thread pool.

Compiles run in threads because xgrammar releases the GIL while compiling (measured: a 100 ms
compile leaves the caller's thread running) and because a compiled xgrammar grammar cannot
cross a process boundary cheaply (serialize_json of a large schema's grammar: ~290 MB, 23 s;
mask shards compile their own copy, from the same recipe).
A C++ compile cannot be interrupted, so a compile past its deadline is *abandoned*: its future
fails with ConstraintError at once, a fresh worker replaces it, and the abandoned thread exits
when its compile ends. At most `compile_threads` compiles may be abandoned at a time; beyond
that no replacement is started, so runaway compiles can never hold more than
2 x compile_threads threads (the queue waits rather than spawning without bound).
"""
from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

from guided.config import EngineConfig
from guided.errors import ConstraintError
from guided.fsm.matcher import Matcher
from guided.fsm.schema_worker import analyse
from guided.fsm.vocab import TokenVocab
from guided.params import ConstraintSpec
from guided.scheduler.policy import default_dfa_max_wait_size

REGEX_BACKENDS = ("xgrammar", "outlines")
log = logging.getLogger(__name__)


@dataclass(eq=False)
class CompiledGrammar:
    spec: ConstraintSpec
    compile_seconds: float
    backend: str  # "xgrammar" | "outlines" | "dfa": the one its next matcher comes from
    _make_matcher: Callable[[], Matcher] = field(repr=False)
    # a large schema's DFA, compiling in the background while xgrammar serves it (-> the DFA's
    # CompiledGrammar, or None where it failed): the matchers made once it is in are the DFA's
    upgrade: Future | None = field(default=None, repr=False)

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (cheap: the compiled grammar is shared)."""
        upgrade = self.upgrade
        if upgrade is not None and upgrade.done():
            dfa = None if upgrade.exception() is not None else upgrade.result()
            if dfa is not None:
                self.backend, self._make_matcher = dfa.backend, dfa._make_matcher
            self.upgrade = None
        return self._make_matcher()


class GrammarCompiler:
    """One per tokenizer. submit() never raises and never blocks; see the module docstring."""

    def __init__(self, tokenizer, *, vocab_size: int, config: EngineConfig,
                 regex_backend: str = "xgrammar", vocab: TokenVocab | None = None):
        """config's open compile settings (None) are a CPU host's here (4 threads, no schema
        processes); the engine resolves them first (policy.resolve_compile_config)."""
        if regex_backend not in REGEX_BACKENDS:
            raise ValueError(f"regex_backend must be one of {REGEX_BACKENDS}")
        from guided.fsm.backends.xgrammar_backend import XGrammarBackend

        self.config = config
        wait = config.dfa_max_wait_size
        self.dfa_max_wait_size = (default_dfa_max_wait_size(sched_idle=False) if wait is None
                                  else wait)
        self.regex_backend = regex_backend
        self.vocab = vocab or TokenVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
        self._xgrammar = XGrammarBackend(self.vocab, config)
        self._outlines = None
        self._dfa_vocab = None
        self._outlines_lock = threading.Lock()
        self._cache: OrderedDict[ConstraintSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        idle = bool(config.compile_sched_idle)
        self._pool = WatchdogPool(num_workers=config.compile_threads or 4,
                                  timeout_s=config.compile_timeout_s, nice=config.compile_nice,
                                  idle=idle)
        # large schemas' DFAs (dfa_max_wait_size), built while xgrammar serves their requests:
        # nobody waits for them, so one thread, lower still than the compiles requests wait
        # for (each is seconds of a core's time, which the step loop needs more while cold)
        self._upgrades = WatchdogPool(
            num_workers=config.dfa_upgrade_threads, timeout_s=config.compile_timeout_s,
            nice=min(19, config.compile_nice + 5), idle=idle,
            name="grammar-dfa-upgrade") if config.dfa_masks else None
        # multi-step calls step DFA grammars on the device (guided/worker/device_dfa.py): their
        # tables are made by worker processes (fsm/table_worker.py), started on first use
        self._wants_tables = config.dfa_masks and config.device_dfa and (
            config.num_scheduler_steps > 1)
        self._table_workers = None
        self._schema_workers = None
        if config.schema_processes:
            from guided.fsm.schema_worker import SchemaWorkers

            self._schema_workers = SchemaWorkers(config.schema_processes)

    # ---- public API ---------------------------------------------------------------------
    def submit(self, spec: ConstraintSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = Future()
            self._cache[spec] = future
            while len(self._cache) > self.config.grammar_cache_size:
                self._cache.popitem(last=False)  # a pending future stays alive with its waiters
        problem = self._precheck(spec)
        if problem is not None:
            future.set_exception(ConstraintError(problem))
            return future
        self._pool.submit(future, lambda: self._compile_sync(spec), label=spec.kind)
        return future

    def compile(self, spec: ConstraintSpec, timeout: float | None = None) -> CompiledGrammar:
        """Blocking convenience for tests and the CLI."""
        try:
            return self.submit(spec).result(timeout=timeout)
        except FutureTimeoutError:
            raise ConstraintError(f"{spec.kind} did not compile within {timeout} s") from None

    def shutdown(self) -> None:
        self._pool.shutdown()
        if self._upgrades is not None:
            self._upgrades.shutdown()
        if self._table_workers is not None:
            self._table_workers.shutdown()
        if self._schema_workers is not None:
            self._schema_workers.shutdown()

    @property
    def xgrammar_tokenizer_info(self):
        """The xgrammar TokenizerInfo its grammars are compiled for (mask shards load it)."""
        return self._xgrammar.tokenizer_info

    # ---- compiling ------------------------------------------------------------------------
    def _precheck(self, spec: ConstraintSpec) -> str | None:
        if not isinstance(spec, ConstraintSpec):
            return f"expected a ConstraintSpec, got {type(spec).__name__}"
        if len(spec.value.encode("utf-8", "surrogatepass")) > self.config.max_grammar_bytes:
            return (f"the {spec.kind} constraint is {len(spec.value)} characters long; the limit "
                    f"is max_grammar_bytes={self.config.max_grammar_bytes}")
        if spec.kind not in ("json_schema", "json_object", "regex", "choice", "grammar"):
            return f"unknown constraint kind {spec.kind!r}"
        return None

    def _compile_sync(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Runs on a pool thread. Raises ConstraintError naming the problem."""
        from guided.fsm.backends.outlines_backend import OutlinesMatcher
        from guided.fsm.backends.xgrammar_backend import XGrammarMatcher, has_long_repetition

        start = time.perf_counter()
        xg, vocab = self._xgrammar, self.vocab
        if spec.kind == "choice" or spec.kind == "regex" and self.regex_backend == "outlines":
            backend = self._outlines_backend()
            if spec.kind == "choice":
                options = json.loads(spec.value)
                if not isinstance(options, list) or not options or not all(
                        isinstance(o, str) and o for o in options):
                    raise ConstraintError("choice must be a non-empty list of non-empty strings")
                index = backend.compile_choice(spec.value)
            else:
                index = backend.compile_regex(spec.value)
            seconds = time.perf_counter() - start
            return CompiledGrammar(spec, seconds, "outlines",
                                   lambda: OutlinesMatcher(index, backend))
        upgrade = None
        if spec.kind == "json_schema":  # a refusal raises ConstraintError
            want_regex = self.config.dfa_masks
            analysed = (analyse(spec.value, want_regex=want_regex)
                        if self._schema_workers is None
                        else self._schema_workers.analyse(spec.value, want_regex=want_regex))
            schema, regex = analysed.schema, analysed.regex
            if regex is not None and analysed.size <= self.dfa_max_wait_size:
                dfa = self._dfa_grammar(spec, regex, start)
                if dfa is not None:
                    return dfa
            elif regex is not None:  # its DFA takes seconds: xgrammar's serves it meanwhile
                upgrade = Future()
                self._upgrades.submit(upgrade, lambda: self._dfa_grammar(spec, regex),
                                      label="json_schema DFA")
            recipe = xg.recipe("json_schema", json.dumps(schema))
        else:
            recipe = xg.recipe(spec.kind, "" if spec.kind == "json_object" else spec.value)
        compiled = xg.compile(recipe)
        seconds = time.perf_counter() - start
        is_json = spec.kind in ("json_schema", "json_object")
        ban = xg.json_ban() if is_json else None
        string_ban = xg.json_string_ban() if is_json else None
        heavy = has_long_repetition(compiled)
        return CompiledGrammar(spec, seconds, "xgrammar",
                               lambda: XGrammarMatcher(compiled, vocab, ban=ban,
                                                       string_ban=string_ban, heavy=heavy,
                                                       recipe=recipe),
                               upgrade=upgrade)

    def _dfa_grammar(self, spec: ConstraintSpec, regex: str,
                     start: float | None = None) -> CompiledGrammar | None:
        """The schema's grammar served by the token-level DFA of its regex (None where
        outlines-core cannot build it); its device tables are made after, by the workers."""
        from guided.fsm.backends.dfa_backend import DfaMatcher

        start = time.perf_counter() if start is None else start
        dfa = self._dfa(regex)
        if dfa is None:
            return None
        if self._table_workers is not None:  # after the compile: nobody waits for it
            dfa.tables_ready = self._table_workers.build_later(
                dfa, self.config.device_dfa_max_index_bytes)
        vocab = self.vocab
        return CompiledGrammar(spec, time.perf_counter() - start, "dfa",
                               lambda: DfaMatcher(dfa, vocab))

    def _dfa(self, regex: str):
        """The regex's token-level DFA, or None where outlines-core fails on it."""
        from guided.fsm.backends.dfa_backend import DfaVocab, TokenDfa

        try:
            with self._outlines_lock:
                if self._dfa_vocab is None:
                    self._dfa_vocab = DfaVocab(self.vocab)
                if self._wants_tables and self._table_workers is None:
                    from guided.fsm.table_worker import TableWorkers

                    v = self._dfa_vocab
                    # a quarter of the cores (the step loop, mask threads and compiles
                    # have the rest), up to 4
                    self._table_workers = TableWorkers(
                        min(4, max(1, (os.cpu_count() or 1) // 4)), eos=v.eos_id,
                        token_map=v.token_map, num_words=v.num_words)
            return TokenDfa(regex, self._dfa_vocab)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException
            log.warning("json schema on xgrammar: outlines-core failed: %s", str(e)[:200])
        return None

    def _outlines_backend(self):
        from guided.fsm.backends.outlines_backend import OutlinesBackend

        with self._outlines_lock:
            if self._outlines is None:
                self._outlines = OutlinesBackend(self.vocab)
            return self._outlines


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Add `nice` to the calling thread's niceness, and with `idle` put it under SCHED_IDLE
    (Linux: a thread's priority is its own, and threads it starts inherit it). Best effort:
    elsewhere, or without permission, a no-op."""
    tid = threading.get_native_id()
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, tid,
                           min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            pass
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


class WatchdogPool:
    """A bounded thread pool whose jobs have a deadline from the moment they start.

    Invariants: live workers <= num_workers; live + abandoned (timed out, still running)
    <= 2 x num_workers, so stuck compiles shrink the pool rather than grow the thread count;
    an abandoned worker rejoins the pool when its compile ends if the pool is short, else exits.
    """

    def __init__(self, *, num_workers: int, timeout_s: float, nice: int = 0,
                 idle: bool = False, name: str = "grammar-compile"):
        self.num_workers = max(1, num_workers)
        self.name = name  # its threads' (the server's stats log names the busiest)
        self.timeout_s = timeout_s
        self.nice = nice
        self.idle = idle  # SCHED_IDLE (lower_thread_priority)
        self._cond = threading.Condition()
        self._jobs: list[tuple[Future, Callable[[], Any], str]] = []
        self._deadlines: list[tuple[float, int, int]] = []  # heap: (deadline, job id, worker id)
        self._running: dict[int, tuple[Future, str, int]] = {}  # worker id -> its current job
        self._abandoned: set[int] = set()
        self._live = 0
        self._ids = itertools.count()
        self._closed = False
        for _ in range(self.num_workers):
            self._spawn()
        threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True).start()

    @property
    def num_abandoned(self) -> int:
        with self._cond:
            return len(self._abandoned)

    @property
    def num_threads(self) -> int:
        """Worker threads alive: never more than 2 x num_workers."""
        with self._cond:
            return self._live + len(self._abandoned)

    def submit(self, future: Future, fn: Callable[[], Any], *, label: str = "job") -> None:
        with self._cond:
            if self._closed:
                future.set_exception(ConstraintError("the grammar compiler is shut down"))
                return
            self._jobs.append((future, fn, label))
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for future, _, _ in self._jobs:
                if not future.done():
                    future.set_exception(ConstraintError("the grammar compiler is shut down"))
            self._jobs.clear()
            self._cond.notify_all()

    def _spawn(self) -> None:  # caller holds the lock (or is __init__)
        self._live += 1
        worker_id = next(self._ids)
        threading.Thread(target=self._work, args=(worker_id,), name=f"{self.name}-{worker_id}",
                         daemon=True).start()

    def _work(self, worker_id: int) -> None:
        lower_thread_priority(self.nice, self.idle)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._live -= 1
                    return
                future, fn, label = self._jobs.pop(0)
                if not future.set_running_or_notify_cancel():
                    continue
                job_id = next(self._ids)
                self._running[worker_id] = (future, label, job_id)
                heapq.heappush(self._deadlines,
                               (time.monotonic() + self.timeout_s, job_id, worker_id))
                self._cond.notify_all()  # wake the watchdog for the new deadline
            try:
                result, error = fn(), None
            except ConstraintError as e:
                result, error = None, e
            except Exception as e:  # a backend bug must fail the request, never the engine
                result, error = None, ConstraintError(f"{label} failed to compile: {e!r}")
            with self._cond:
                self._running.pop(worker_id, None)
                if not future.done():
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
                if worker_id in self._abandoned:
                    self._abandoned.discard(worker_id)
                    if self._live >= self.num_workers or self._closed:
                        return
                    self._live += 1  # the pool is short: rejoin it

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, job_id, worker_id = heapq.heappop(self._deadlines)
                    self._expire(worker_id, job_id)
                while self._deadlines and not self._is_running(*self._deadlines[0][1:]):
                    heapq.heappop(self._deadlines)  # finished in time
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._cond.wait(timeout=wait)

    def _is_running(self, job_id: int, worker_id: int) -> bool:
        running = self._running.get(worker_id)
        return running is not None and running[2] == job_id

    def _expire(self, worker_id: int, job_id: int) -> None:  # caller holds the lock
        if not self._is_running(job_id, worker_id) or worker_id in self._abandoned:
            return
        future, label, _ = self._running[worker_id]
        if not future.done():
            future.set_exception(ConstraintError(
                f"{label} compile timed out after {self.timeout_s:g} s (compile_timeout_s)"))
        self._abandoned.add(worker_id)
        self._live -= 1
        if self._live + len(self._abandoned) < 2 * self.num_workers:
            self._spawn()
