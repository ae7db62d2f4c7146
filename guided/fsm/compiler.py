"""Asynchronous grammar compilation: an LRU of compiles in front of a watchdog thread pool.

Threads, not processes: xgrammar releases the GIL while compiling, and a compiled grammar cannot
cross a process boundary cheaply. Every submit() gets a ticket (a future of its own) on the
spec's one compile: a compile nobody waits for is dropped; past compile_timeout_s its tickets
fail with CompileTimeoutError (a 503, never cached) while it goes on to fill the cache; a new
spec that would not start in time is refused at once, so a storm of new schemas degrades to
quick 503s. An offline batch's compiles (bounded=False) are never refused nor shed.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import get_args

from guided.errors import CompileTimeoutError, ConstraintError
from guided.fsm.backends.llguidance_backend import prefers_llguidance
from guided.fsm.grammar_bounds import check_grammar_bounds, schema_problem
from guided.fsm.lark_grammar import is_lark, lark_to_ebnf
from guided.fsm.matcher import Matcher
from guided.fsm.schema_worker import check
from guided.fsm.settings import CompileSettings
from guided.fsm.structural_tags import checked_structural_tag
from guided.fsm.vocab import TokenVocab
from guided.fsm.watchdog_pool import WatchdogPool, settle
from guided.params import ConstraintKind, ConstraintSpec

# compiles waiting for a thread: past this a new spec is refused at once (a 503 to retry)
MAX_QUEUED_COMPILES = 256
# regexes, grammars and schemas up to this long have their bounds checked at submit (ms)
QUICK_CHECK_CHARS = 2000
WARM_UP_SCHEMA = '{"type": "object", "properties": {"ok": {"type": "boolean"}}}'
log = logging.getLogger(__name__)


@dataclass(eq=False)
class CompiledGrammar:
    spec: ConstraintSpec
    compile_seconds: float
    backend: str  # "xgrammar" | "llguidance"
    matcher: Callable[[], Matcher] = field(repr=False)  # a fresh matcher at the start


@dataclass(eq=False)
class _Compile:
    outcome: Future  # the compile's own (cached): a CompiledGrammar or a ConstraintError
    tickets: set[Future] = field(default_factory=set)
    overdue: bool = False  # past compile_timeout_s: it goes on in the background


class GrammarCompiler:
    """One per tokenizer. submit() never raises and never blocks."""

    def __init__(self, tokenizer, *, vocab_size: int, config: CompileSettings | None = None):
        from guided.fsm.backends.xgrammar_backend import XGrammarBackend

        config = config or CompileSettings()
        self.config = config
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
        self._tokenizer = tokenizer  # llguidance builds its own from it (on first use)
        self._llguidance = None
        self._xgrammar = XGrammarBackend(self.vocab, config)
        self._llguidance_lock = threading.Lock()
        self._cache: OrderedDict[ConstraintSpec, _Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = WatchdogPool(num_workers=config.compile_threads,
                                  timeout_s=config.compile_timeout_s, nice=config.compile_nice,
                                  idle=config.compile_sched_idle,
                                  max_wait_s=config.compile_timeout_s)
        self._schema_workers = None
        if config.schema_processes:
            from guided.fsm.schema_worker import SchemaWorkers

            self._schema_workers = SchemaWorkers(config.schema_processes)

    def submit(self, spec: ConstraintSpec, *, bounded: bool = True) -> Future:
        """A ticket for spec's CompiledGrammar (a ConstraintError for a bad spec,
        CompileTimeoutError to retry); cancel it when no longer waiting. bounded: refused at
        once where it would not start in time, and shed while queued (a server's requests)."""
        ticket: Future = Future()
        with self._lock:
            entry = self._cache.get(spec)
            if entry is not None and entry.outcome.cancelled():  # shed or dropped: start afresh
                entry = None
            if entry is not None:
                self._cache.move_to_end(spec)
            else:
                busy = self._busy() if bounded else None
                if busy is not None:
                    ticket.set_exception(CompileTimeoutError(busy))
                    return ticket
                entry = self._cache[spec] = _Compile(Future())
                while len(self._cache) > self.config.grammar_cache_size:
                    self._cache.popitem(last=False)  # a pending compile goes on for its tickets
                self._start(spec, entry, sheddable=bounded)
            if not entry.outcome.done():
                if entry.overdue:
                    ticket.set_exception(CompileTimeoutError(
                        f"the {spec.kind} constraint is still compiling after "
                        f"{self.config.compile_timeout_s:g} s (compile_timeout_s); retry later"))
                    return ticket
                entry.tickets.add(ticket)
        entry.outcome.add_done_callback(lambda outcome: _settle(ticket, outcome))
        ticket.add_done_callback(lambda t: self._left(entry, t))
        return ticket

    def _busy(self) -> str | None:
        """(lock held) Why a new spec cannot be compiled in time now, or None."""
        if self._pool.num_queued >= MAX_QUEUED_COMPILES:
            return (f"{MAX_QUEUED_COMPILES} constraints are waiting to compile; "
                    "retry this one later")
        if self._pool.room() <= 0:
            return ("the grammar compiler is busy: this constraint would not start compiling "
                    f"within compile_timeout_s={self.config.compile_timeout_s:g} s; retry later")
        return None

    def _start(self, spec: ConstraintSpec, entry: _Compile, *, sheddable: bool) -> None:
        """(lock held) Queue the compile, or settle it at once where the spec is refused."""
        limit = self.config.max_grammar_bytes
        if len(spec.value.encode("utf-8", "surrogatepass")) > limit:
            problem = (f"the {spec.kind} constraint is {len(spec.value)} characters long; the "
                       f"limit is max_grammar_bytes={limit}")
        elif spec.kind not in get_args(ConstraintKind):
            problem = f"unknown constraint kind {spec.kind!r}"
        else:
            problem = quick_problem(spec)
        if problem is not None:
            entry.outcome.set_exception(ConstraintError(problem))
            return
        self._pool.submit(entry.outcome, lambda: self._compile_sync(spec), label=spec.kind,
                          on_overdue=lambda: self._overdue(spec, entry), sheddable=sheddable)

    def _left(self, entry: _Compile, ticket: Future) -> None:
        """A ticket is settled or cancelled: a compile nobody waits for any more is dropped."""
        with self._lock:
            entry.tickets.discard(ticket)
            if entry.tickets or entry.outcome.done() or not ticket.cancelled():
                return
        self._pool.drop(entry.outcome)  # a queued one is cancelled: the next submit starts afresh

    def _overdue(self, spec: ConstraintSpec, entry: _Compile) -> None:
        """The compile ran past compile_timeout_s: its tickets fail (retryable), it goes on."""
        with self._lock:
            if entry.outcome.done():
                return
            entry.overdue = True
            tickets, entry.tickets = list(entry.tickets), set()
        log.warning("a %s compile ran past compile_timeout_s=%g s; %d waiting request(s) get "
                    "a 503, it goes on in the background", spec.kind,
                    self.config.compile_timeout_s, len(tickets))
        error = CompileTimeoutError(
            f"compiling the {spec.kind} constraint timed out after "
            f"{self.config.compile_timeout_s:g} s (compile_timeout_s); retry later")
        for ticket in tickets:
            settle(ticket, error=error)

    def warm_up(self) -> None:
        """Build what the first compiles would (the backends' imports, llguidance's tokenizer),
        so that a server pays it at start rather than in its first requests' time."""
        self.compile(ConstraintSpec("json_schema", WARM_UP_SCHEMA), timeout=None)
        if self.config.llguidance:
            try:
                self._llguidance_backend()
            except Exception as e:  # noqa: BLE001 - not installed: xgrammar serves all
                log.warning("llguidance is unavailable (%s): every JSON schema compiles on "
                            "xgrammar", e)

    def _llguidance_backend(self):
        """The one LLGuidanceBackend, built on first use (its tokenizer: ~0.25 s)."""
        from guided.fsm.backends.llguidance_backend import LLGuidanceBackend

        with self._llguidance_lock:
            if self._llguidance is None:
                self._llguidance = LLGuidanceBackend(self._tokenizer, self.vocab)
            return self._llguidance

    def compile(self, spec: ConstraintSpec, timeout: float | None = None) -> CompiledGrammar:
        try:
            return self.submit(spec).result(timeout=timeout)
        except FutureTimeoutError:
            raise ConstraintError(f"{spec.kind} did not compile within {timeout} s") from None

    def shutdown(self) -> None:
        self._pool.shutdown()
        if self._schema_workers is not None:
            self._schema_workers.shutdown()

    def _compile_sync(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Runs on a pool thread. Raises ConstraintError naming the problem, a grammar no token
        of the vocabulary can start included (it needs bytes no token spells)."""
        grammar = self._build(spec)
        if not grammar.matcher().allows_a_token(self.vocab.vocab_size):
            raise ConstraintError(f"the {spec.kind} constraint cannot be completed with this "
                                  "model's vocabulary: no token can start it (it needs bytes "
                                  "no token spells)")
        return grammar

    def _build(self, spec: ConstraintSpec) -> CompiledGrammar:
        from guided.fsm.backends.xgrammar_backend import XGrammarMatcher, choice_regex

        start = time.perf_counter()
        xg, vocab = self._xgrammar, self.vocab
        if spec.kind == "choice":
            options = json.loads(spec.value)
            if not isinstance(options, list) or not options or not all(
                    isinstance(o, str) and o for o in options):
                raise ConstraintError("choice must be a non-empty list of non-empty strings")
            recipe = xg.recipe("regex", choice_regex(options))
        elif spec.kind == "json_schema":  # a refusal raises ConstraintError
            schema = (check(spec.value) if self._schema_workers is None
                      else self._schema_workers.check(spec.value))
            if self.config.llguidance and prefers_llguidance(schema):
                served = self._llguidance_grammar(spec, schema, start)
                if served is not None:
                    return served
            recipe = xg.recipe("json_schema", json.dumps(schema))
        elif spec.kind == "structural_tag":
            recipe = xg.recipe("structural_tag", checked_structural_tag(spec.value))
        elif spec.kind == "grammar" and is_lark(spec.value):  # vLLM's guided_grammar dialect
            recipe = xg.recipe("grammar", lark_to_ebnf(spec.value))
        else:
            recipe = xg.recipe(spec.kind, "" if spec.kind == "json_object" else spec.value)
        compiled = xg.compile(recipe)
        ban = xg.json_ban() if spec.kind in ("json_schema", "json_object") else None
        return CompiledGrammar(spec, time.perf_counter() - start, "xgrammar",
                               lambda: XGrammarMatcher(compiled, vocab, ban=ban))

    def _llguidance_grammar(self, spec: ConstraintSpec, schema: dict,
                            start: float) -> CompiledGrammar | None:
        """The checked schema served by llguidance, or None: ineligible or refused by it."""
        from guided.fsm.backends.llguidance_backend import LLGuidanceMatcher, llguidance_schema

        restated = llguidance_schema(schema)
        if restated is None:
            return None
        try:
            backend = self._llguidance_backend()
            initial = backend.start(restated)
        except Exception as e:  # noqa: BLE001 - llguidance's refusal: xgrammar serves it
            log.info("json schema on xgrammar: llguidance: %s", str(e)[:200])
            return None
        return CompiledGrammar(spec, time.perf_counter() - start, "llguidance",
                               lambda: LLGuidanceMatcher(initial, backend))


def quick_problem(spec: ConstraintSpec) -> str | None:
    """Why a short regex, grammar or JSON schema can never end, found in milliseconds without
    compiling; else None. The server asks before the request queues behind busy compiles."""
    if len(spec.value) > QUICK_CHECK_CHARS:
        return None
    if spec.kind == "json_schema":
        return schema_problem(spec.value)
    if spec.kind == "regex" or spec.kind == "grammar" and not is_lark(spec.value):
        from guided.fsm.backends.xgrammar_backend import Recipe, grammar_of

        try:
            grammar = grammar_of(Recipe(spec.kind, spec.value))
        except Exception:  # noqa: BLE001 - a syntax error: the compile reports it
            return None
        try:
            check_grammar_bounds(grammar.serialize_json(), kind=spec.kind)
        except ConstraintError as e:
            return str(e)
    return None


def _settle(ticket: Future, outcome: Future) -> None:
    """A ticket takes its compile's outcome, unless it was settled or cancelled first."""
    if outcome.cancelled():  # dropped from the queue (shut down, or nobody waited)
        settle(ticket, error=CompileTimeoutError("the grammar compiler is busy: this constraint "
                                                 "could not start compiling in time; retry later"))
    else:
        settle(ticket, None if outcome.exception() else outcome.result(), outcome.exception())
