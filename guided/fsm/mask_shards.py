"""Mask shards: processes that fill the mask rows of constrained requests beside the step loop.

At concurrency 256 the grammar work of a step (accepting 233 requests' tokens, filling their
rows, walking their drafts) costs the step loop ~6 ms of host time on an H200, more than a small
model's forward pass, and threads cannot take it over: the Python around xgrammar's GIL-free
calls contends with the loop's own (concurrent_masks, measured slower in session 5). Here each
shard process holds a mirror matcher per request placed on it, fed the request's committed
tokens with each step's fills, and writes its rows into the step's mask buffer, a file mapped by
both processes (HostBitmasks(shared=True)). The loop sends one message per shard, goes on with
its own work, and collects one reply per shard before the step samples.

The shards also walk their requests' jump-forward drafts (shard_drafts.py), AND the token bans
into their rows and count each request's last row for lazy masks; shard_grammars.py places the
mirrors and sends the grammars, as the recipes they were compiled from (each shard compiles
its copy). The engine keeps its own matchers, so a row is filled (a draft walked) in-process
whenever a mirror cannot: a shard starting, a grammar being compiled there (a cold grammar
never waits for it), one too large to send, a shard that failed (the engine never depends on a
shard being alive). Only xgrammar grammars go to shards."""
from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Listener

from guided.fsm.shard_drafts import ShardDrafts
from guided.fsm.shard_grammars import MAX_SHIPPED_BYTES, ShardGrammars, _Mirror
from guided.engine.step_times import StepTimes

log = logging.getLogger(__name__)

Entry = tuple  # (matcher, drafts, first row)


@dataclass(eq=False)
class _Shard:
    index: int
    process: subprocess.Popen
    conn: object
    ready: bool = False
    drafting: bool = False  # it walks drafts (its tokenizer set up)
    dead: bool = False
    num_mirrors: int = 0
    users: Counter = field(default_factory=Counter)  # gid -> mirrors placed here
    loaded: OrderedDict = field(default_factory=OrderedDict)  # gids loaded, least recent first
    loading: set = field(default_factory=set)  # gids sent, not loaded yet
    opens: list = field(default_factory=list)  # (request_id, gid, ban, prompt) for the next message
    closes: list = field(default_factory=list)  # request_ids for the next message
    bans: set = field(default_factory=set)  # ban keys sent
    awaiting: int | None = None  # the step message whose reply is not taken yet


class PendingFill:
    """The shards' replies a step still waits for."""

    def __init__(self, shards: "MaskShards", sent: list):
        self._shards = shards
        self._sent = sent  # (shard, seq, entries it fills)

    def wait(self) -> tuple[list[Entry], str | None, dict[int, int]]:
        """Blocks for the replies: (entries whose shard failed, to fill in-process; the first
        rejected-draft error, else None; the tokens each filled entry's last row allows, by
        row)."""
        return self._shards._collect(self._sent)


class MaskShards(ShardDrafts, ShardGrammars):
    def __init__(self, tokenizer_info, num_shards: int, *, drafting: tuple | None = None,
                 max_shipped_bytes: int = MAX_SHIPPED_BYTES, times: StepTimes | None = None,
                 idle: bool = False, compile_threads: int = 1):
        """drafting: (the Rust tokenizer as JSON, token bytes, EOS ids, special ids), for the
        shards to walk jump-forward drafts too (ask_drafts); None: fills only. times: where
        the busiest shard's seconds a message go (the step loop's waits beside them). idle:
        the shards compile their grammars under SCHED_IDLE (as the engine's compiles run),
        each spread over compile_threads threads."""
        self.num_shards = num_shards
        self.times = times
        self.drafting = drafting is not None
        self.max_shipped_bytes = max_shipped_bytes
        self._shards: list[_Shard] = []
        self._lock = threading.RLock()
        self._gids: dict[int, tuple] = {}  # id(CompiledGrammar) -> (weak ref to it, gid)
        self._next_gid = 0
        self._unshippable: set[int] = set()
        self._mirrors: dict[str, _Mirror] = {}
        self._seq = 0
        self._closed = False
        # spawned off the step loop: a shard imports torch and xgrammar (seconds)
        self._bans: dict[int, frozenset] = {}  # id(ban ids) -> ban ids, as sent to shards
        self._starter = threading.Thread(
            target=self._start, args=(tokenizer_info, (drafting, idle, compile_threads)),
            name="mask-shards-start", daemon=True)
        self._starter.start()

    def _start(self, tokenizer_info, greeting: tuple) -> None:
        """Each shard is `python -m guided.fsm.mask_shard_worker`, connected back over a local
        socket (not multiprocessing's spawn, which re-imports the caller's __main__)."""
        try:
            info_json = tokenizer_info.serialize_json()
            authkey = secrets.token_bytes(16)
            folder = tempfile.mkdtemp(prefix="guided-shards-")
            with Listener(os.path.join(folder, "socket"), "AF_UNIX", authkey=authkey) as listener:
                env = {**os.environ, "GUIDED_SHARD_AUTHKEY": authkey.hex()}
                for index in range(self.num_shards):
                    process = subprocess.Popen(
                        [sys.executable, "-m", "guided.fsm.mask_shard_worker", listener.address],
                        env=env, stdin=subprocess.DEVNULL)
                    conn = listener.accept()
                    conn.send((info_json, *greeting))
                    with self._lock:
                        if self._closed:
                            process.kill()
                            return
                        self._shards.append(_Shard(index, process, conn))
            os.rmdir(folder)
            log.info("mask shards: %d processes started", self.num_shards)
        except Exception:  # noqa: BLE001 - every row is then filled in-process
            log.exception("mask shards did not start; grammar masks stay in-process")

    @property
    def num_ready(self) -> int:
        return sum(1 for shard in self._live())

    def wait_ready(self, timeout: float) -> bool:
        """Whether every shard started within timeout seconds (they start in the background)."""
        deadline = time.monotonic() + timeout
        while self.num_ready < self.num_shards:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _live(self) -> list[_Shard]:
        live = []
        for shard in self._shards:
            if shard.dead:
                continue
            if not shard.ready:
                try:
                    if shard.conn.poll():
                        reply = shard.conn.recv()
                        shard.ready = reply[0] == "ready"
                        shard.drafting = self.drafting and reply[1]
                except (EOFError, OSError):
                    self._fail(shard, "exited while starting")
                    continue
            if shard.ready:
                live.append(shard)
        return live

    # -- a step --------------------------------------------------------------------------------
    def dispatch(self, entries: list[tuple], segment: tuple[str, int] | None
                 ) -> tuple[list[Entry], list[Entry], PendingFill | None]:
        """entries: (request, drafts, first row) of live constrained requests. Sends the rows
        whose mirror is ready to the shards; returns (entries to fill in-process, entries sent,
        the replies to wait for), entries as (matcher, drafts, first row)."""
        try:
            return self._dispatch(entries, segment)
        except Exception:  # noqa: BLE001 - a fault here must not fail the step
            log.exception("mask shards failed; grammar masks stay in-process")
            with self._lock:
                for shard in self._shards:
                    self._fail(shard, "dispatch failed")
            return [(r.matcher, d, first) for r, d, first in entries], [], None

    def _dispatch(self, entries: list[tuple], segment: tuple[str, int] | None
                  ) -> tuple[list[Entry], list[Entry], PendingFill | None]:
        with self._lock:
            live = self._live() if segment is not None else []
            if not live:
                return [(r.matcher, d, first) for r, d, first in entries], [], None
            local: list[Entry] = []
            fills: dict[_Shard, tuple[list, list[Entry]]] = {}
            mirrors = self._mirrors
            for request, drafts, first in entries:
                mirror = mirrors.get(request.request_id)
                if mirror is None:
                    mirror = mirrors[request.request_id] = self._place(request.matcher, live)
                shard = mirror.shard
                if shard is None or shard.dead or mirror.gid not in shard.loaded:
                    local.append((request.matcher, drafts, first))
                    continue
                if not mirror.opened and not self._open(shard, request, mirror):
                    local.append((request.matcher, drafts, first))
                    continue
                out = request.output_token_ids
                messages, mine = fills.setdefault(shard, ([], []))
                messages.append((request.request_id, out[mirror.synced:], drafts, first))
                mine.append((request.matcher, drafts, first))
                mirror.synced = len(out)
            for shard in live:  # a shard loading grammars is asked for news each step
                if shard not in fills and shard.loading:
                    fills[shard] = ([], [])
            path, capacity = segment
            sent = []
            for shard, (messages, mine) in fills.items():
                seq = self._send(shard, "step", path, capacity, messages)
                if seq is None:
                    local.extend(mine)
                    continue
                shard.awaiting = seq
                sent.append((shard, seq, mine))
            remote = [entry for _, _, mine in sent for entry in mine]
            return local, remote, PendingFill(self, sent) if sent else None

    def _send(self, shard: _Shard, kind: str, *payload) -> int | None:
        """Sends (kind, seq, opens, closes, *payload) to the shard: its seq, or None where the
        shard is (now) dead."""
        if shard.awaiting is not None:  # a step dropped its fill without waiting
            self._collect([(shard, shard.awaiting, [])])
        if shard.dead:
            return None
        self._seq += 1
        try:
            shard.conn.send((kind, self._seq, shard.opens, shard.closes, *payload))
        except (OSError, ValueError):
            self._fail(shard, "its pipe closed")
            return None
        shard.opens, shard.closes = [], []
        return self._seq

    def _collect(self, sent: list) -> tuple[list[Entry], str | None, dict[int, int]]:
        failed: list[Entry] = []
        error = None
        widths: dict[int, int] = {}
        busiest = 0.0
        for shard, seq, mine in sent:
            reply = self._recv(shard, "step", seq)
            with self._lock:
                shard.awaiting = None
                if reply is None or shard.dead:  # dead: it failed drafting, its rows unsure
                    failed.extend(mine)
                    continue
                _, _, problem, loaded, bad, counts, busy = reply
                busiest = max(busiest, busy)
                for gid in loaded:
                    shard.loading.discard(gid)
                    shard.loaded[gid] = None
                for gid in bad:
                    shard.loading.discard(gid)
                    self._unshippable.add(gid)
                if problem is None:
                    widths.update((first + len(drafts), count)
                                  for (_, drafts, first), count in zip(mine, counts))
                    continue
                kind, message = problem
                if kind == "draft":  # the grammar's verdict, as an in-process fill gives it
                    error = error or message
                else:  # the mirror cannot be trusted: its rows are filled here
                    self._fail(shard, message)
                    failed.extend(mine)
        self._note_busy("shards: fill, busiest (part)", busiest)
        return failed, error, widths

    def _note_busy(self, name: str, seconds: float) -> None:
        if self.times is not None and seconds:
            self.times.seconds[name] += seconds

    def _fail(self, shard: _Shard, why: str) -> None:
        if shard.dead:
            return
        shard.dead = True
        log.warning("mask shard %d failed (%s); its requests' masks are filled in-process",
                    shard.index, why)
        shard.process.kill()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for shard in self._shards:
                if not shard.dead:
                    try:
                        shard.conn.send(("stop",))
                    except (OSError, ValueError):
                        pass
        for shard in self._shards:
            try:
                shard.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                shard.process.kill()
