"""The body of a mask shard process (guided/fsm/mask_shards.py says why they exist).

It holds a mirror matcher for each request the engine placed on it, fed the request's
committed tokens, and fills those requests' rows of a step's mask buffer (a file the engine
mapped in memory too). Messages, in order on one pipe:

  ("load", gid, path)           load a compiled grammar serialized to a file (on a loader thread:
                                it may take tens of ms, and fills go on meanwhile); no reply
  ("drop", gid)                 forget a grammar no mirror uses; no reply
  ("step", seq, path, capacity, opens, closes, fills)
      closes: [request_id]; opens: [(request_id, gid)], gids already loaded;
      fills: [(request_id, committed tokens since the last fill, drafts, first row)]
      reply: ("step", seq, (kind, error) or None, gids loaded since, gids that failed to
      load); kind "draft": a draft the grammar rejects, "fault": the mirror is off
  ("stop",)

The first message is the xgrammar TokenizerInfo as JSON; it replies ("ready",) once its
imports and the tokenizer are in place. Run as `python -m guided.fsm.mask_shard_worker ADDRESS`
(GUIDED_SHARD_AUTHKEY in the environment): it connects back to the engine's listener.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

MAX_MAPPED = 4  # mask buffers kept mapped (the engine grows its two buffers rarely)


def serve(conn) -> None:
    import torch
    import xgrammar as xgr

    from guided.fsm.bitmask_fill import rejected_draft, traverse_chain

    torch.set_num_threads(1)
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    except (EOFError, OSError):  # the engine exited while this shard was starting
        return
    grammars: dict[int, object] = {}
    matchers: dict[str, object] = {}
    mapped: OrderedDict[str, torch.Tensor] = OrderedDict()
    loader = ThreadPoolExecutor(1, thread_name_prefix="grammar-load")
    lock = threading.Lock()
    loaded: list[int] = []
    failed: list[int] = []
    batch = xgr.BatchGrammarMatcher(max_threads=1)

    def load(gid: int, path: str) -> None:
        try:
            with open(path) as f:
                grammar = xgr.CompiledGrammar.deserialize_json(f.read(), info)
        except Exception:  # noqa: BLE001 - the engine fills this grammar's rows itself
            with lock:
                failed.append(gid)
            return
        with lock:
            grammars[gid] = grammar
            loaded.append(gid)

    def buffer(path: str, capacity: int) -> torch.Tensor:
        rows = mapped.get(path)
        if rows is None:
            with open(path, "r+b") as f:
                data = mmap.mmap(f.fileno(), 0)
            rows = mapped[path] = torch.frombuffer(data, dtype=torch.int32).view(capacity, -1)
            while len(mapped) > MAX_MAPPED:
                mapped.popitem(last=False)
        mapped.move_to_end(path)
        return rows

    def step(path: str, capacity: int, opens, closes, fills) -> tuple | None:
        for request_id in closes:
            matchers.pop(request_id, None)
        with lock:
            for request_id, gid in opens:
                matchers[request_id] = xgr.GrammarMatcher(grammars[gid])
        bitmask = buffer(path, capacity)
        plain, chains = [], []
        for request_id, tokens, drafts, first in fills:
            matcher = matchers[request_id]
            for token in tokens:
                if not matcher.accept_token(token):
                    return "fault", f"the mirror of {request_id} rejected token {token}"
            if drafts:
                chains.append((matcher, drafts, first))
            else:
                plain.append((matcher, first))
        if plain:
            batch.batch_fill_next_token_bitmask([m for m, _ in plain], bitmask,
                                                indices=[row for _, row in plain])
        for matcher, drafts, first in chains:
            traverse_chain(matcher, drafts, bitmask[first:first + len(drafts) + 1])
        error = rejected_draft([(drafts, first) for _, drafts, first in chains], bitmask)
        return None if error is None else ("draft", error)

    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine went away
            return
        kind = message[0]
        if kind == "load":
            loader.submit(load, message[1], message[2])
        elif kind == "drop":
            with lock:
                grammars.pop(message[1], None)
        elif kind == "step":
            seq, path, capacity, opens, closes, fills = message[1:]
            try:
                error = step(path, capacity, opens, closes, fills)
            except Exception as e:  # noqa: BLE001 - reported; the engine fills locally
                error = "fault", f"{type(e).__name__}: {e}"
            with lock:
                news, bad = loaded[:], failed[:]
                loaded.clear()
                failed.clear()
            conn.send(("step", seq, error, news, bad))
        elif kind == "stop":
            return


def main() -> None:
    from multiprocessing.connection import Client

    conn = Client(sys.argv[1], "AF_UNIX",
                  authkey=bytes.fromhex(os.environ.pop("GUIDED_SHARD_AUTHKEY")))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
