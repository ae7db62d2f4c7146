"""The body of a mask shard process (guided/fsm/mask_shards.py says why they exist).

It holds a mirror matcher for each request the engine placed on it, fed the request's
committed tokens, fills those requests' rows of a step's mask buffer (a file the engine
mapped in memory too) and walks their jump-forward drafts. Messages, in order on one pipe:

  ("load", gid, recipe)         compile a grammar from the recipe the engine compiled its own from
                                (xgrammar_backend.Recipe's fields), on a loader thread (it may
                                take seconds, and fills go on meanwhile); no reply
  ("drop", gid)                 forget a grammar no mirror uses; no reply
  ("ban", key, token ids)       tokens some grammars never allow (their matchers' ban): ANDed
                                into the rows it fills, and drafts never hold them; no reply
  ("drafts", seq, opens, closes, asks)
      asks: [(request_id, committed tokens since the last sync, DraftAsk fields)]
      reply: ("drafts", seq, [(anchor, drafts, number forced)] or None on a fault, seconds
      spent)
  ("step", seq, opens, closes, path, capacity, fills)
      closes: [request_id]; opens: [(request_id, gid, ban key or None, prompt ids)], gids
      already loaded; fills: [(request_id, committed tokens since the last sync, drafts,
      first row)]
      reply: ("step", seq, (kind, error) or None, gids loaded since, gids that failed to
      load, the tokens each fill's last row allows, counted before its ban, seconds spent);
      kind "draft": a draft the grammar rejects, "fault": the mirror is off
  ("stop",)

The first message is (the xgrammar TokenizerInfo as JSON, what drafting needs or None: the
Rust tokenizer as JSON, token bytes, EOS ids, special ids; whether its compiles run under
SCHED_IDLE; the threads each compile spreads over); it replies ("ready", whether it walks
drafts) once its imports and the tokenizer are in place. Run as
`python -m guided.fsm.mask_shard_worker ADDRESS` (GUIDED_SHARD_AUTHKEY in the environment): it
connects back to the engine's listener.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

MAX_MAPPED = 4  # mask buffers kept mapped (the engine grows its two buffers rarely)


def serve(conn) -> None:
    import torch
    import xgrammar as xgr

    from guided.fsm.backends.xgrammar_backend import (
        Recipe,
        TokenBan,
        XGrammarMatcher,
        compile_recipe,
        token_ban,
    )
    from guided.masks.bitmask_fill import (
        allowed_counts,
        apply_bans,
        note_ban,
        rejected_draft,
        traverse_chain,
    )
    from guided.fsm.jump_forward import CachedEncoder, DraftAsk, make_drafts
    from guided.fsm.vocab import TokenVocab
    from guided.fsm.watchdog_pool import lower_thread_priority
    from guided.engine.ngram import NgramIndex

    torch.set_num_threads(1)
    try:
        info_json, drafting, idle, compile_threads = conn.recv()
    except (EOFError, OSError):  # the engine exited while this shard was starting
        return
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=compile_threads, cache_enabled=False)
    encoder = vocab = None
    if drafting is not None:
        try:
            backend_json, token_bytes, eos_ids, special_ids = drafting
            encoder = CachedEncoder.from_backend_json(backend_json)
            vocab = TokenVocab(token_bytes, tuple(eos_ids), frozenset(special_ids),
                               len(token_bytes))
        except Exception:  # noqa: BLE001 - it fills rows; the engine walks the drafts
            encoder = vocab = None
    broken: list[str] = []  # a mirror went out of step while drafting: every fill is refused
    grammars: dict[int, object] = {}
    bans: dict[int, TokenBan] = {}
    mirrors: dict[str, _Mirror] = {}
    mapped: OrderedDict[str, torch.Tensor] = OrderedDict()
    # below the fills, as the engine's compiles are below its step loop (and their threads)
    loader = ThreadPoolExecutor(2, thread_name_prefix="grammar-load",
                                initializer=lower_thread_priority, initargs=(10, idle))
    lock = threading.Lock()
    loaded: list[int] = []
    failed: list[int] = []
    batch = xgr.BatchGrammarMatcher(max_threads=1)

    def load(gid: int, recipe: tuple) -> None:
        try:
            grammar = compile_recipe(compiler, Recipe(*recipe))
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

    def open_and_close(opens, closes) -> None:
        for request_id in closes:
            mirrors.pop(request_id, None)
        with lock:
            for request_id, gid, ban_key, prompt in opens:
                grammar = grammars[gid]
                ban = bans.get(ban_key)
                matcher = (XGrammarMatcher(grammar, vocab, ban=ban)
                           if vocab is not None else None)
                mirrors[request_id] = _Mirror(
                    xgr.GrammarMatcher(grammar) if matcher is None else matcher.xgrammar_matcher,
                    matcher, prompt, ban)

    def sync(request_id: str, tokens: list[int]) -> _Mirror:
        mirror = mirrors[request_id]
        accept = mirror.matcher.accept_token if mirror.matcher else mirror.xgrammar.accept_token
        for token in tokens:
            if not accept(token):
                raise RuntimeError(f"the mirror of {request_id} rejected token {token}")
        mirror.outputs.extend(tokens)
        return mirror

    def propose(opens, closes, asks) -> list:
        open_and_close(opens, closes)
        results = []
        for request_id, tokens, room, lookup_tokens, assumed in asks:
            mirror = sync(request_id, tokens)
            try:
                lookup = None
                if lookup_tokens:
                    if mirror.ngram is None:
                        mirror.ngram = NgramIndex(vocab.special_ids)
                    mirror.ngram.sync(mirror.prompt, mirror.outputs)
                    lookup = mirror.ngram
                results.append(make_drafts(encoder, vocab.token_bytes, mirror.matcher,
                                           mirror.outputs, DraftAsk(room, lookup_tokens, assumed),
                                           lookup))
            except Exception:  # noqa: BLE001 - as in the loop: no drafts this time
                results.append((None, [], 0))
        return results

    def step(path: str, capacity: int, opens, closes, fills) -> tuple[tuple | None, list]:
        """(the problem or None, the tokens each fill's last row allows)"""
        open_and_close(opens, closes)
        bitmask = buffer(path, capacity)
        plain, chains, banned = [], [], {}
        for request_id, tokens, drafts, first in fills:
            try:
                mirror = sync(request_id, tokens)
            except RuntimeError as e:
                return ("fault", str(e)), []
            if drafts:
                chains.append((mirror.xgrammar, drafts, first))
            else:
                plain.append((mirror.xgrammar, first))
            note_ban(banned, mirror, range(first, first + len(drafts) + 1))
        if plain:
            batch.batch_fill_next_token_bitmask([m for m, _ in plain], bitmask,
                                                indices=[row for _, row in plain])
        for matcher, drafts, first in chains:
            traverse_chain(matcher, drafts, bitmask[first:first + len(drafts) + 1])
        error = rejected_draft([(drafts, first) for _, drafts, first in chains], bitmask)
        widths = allowed_counts(bitmask, [first + len(drafts) for _, _, drafts, first in fills])
        apply_bans(bitmask, banned)
        return (None if error is None else ("draft", error)), widths.tolist()

    conn.send(("ready", encoder is not None))
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
        elif kind == "ban":
            bans[message[1]] = token_ban(frozenset(message[2]), info.vocab_size)
        elif kind == "drafts":
            seq, opens, closes, asks = message[1:]
            started = time.perf_counter()
            try:
                results = propose(opens, closes, asks)
            except Exception as e:  # noqa: BLE001 - the engine proposes these itself
                results = None
                broken.append(f"drafting failed: {type(e).__name__}: {e}")
            conn.send(("drafts", seq, results, time.perf_counter() - started))
        elif kind == "step":
            seq, opens, closes, path, capacity, fills = message[1:]
            started = time.perf_counter()
            try:
                error, widths = (("fault", broken[0]), []) if broken else step(
                    path, capacity, opens, closes, fills)
            except Exception as e:  # noqa: BLE001 - reported; the engine fills locally
                error, widths = ("fault", f"{type(e).__name__}: {e}"), []
            with lock:
                news, bad = loaded[:], failed[:]
                loaded.clear()
                failed.clear()
            conn.send(("step", seq, error, news, bad, widths, time.perf_counter() - started))
        elif kind == "stop":
            return


class _Mirror:
    __slots__ = ("ban", "matcher", "ngram", "outputs", "prompt", "xgrammar")

    def __init__(self, xgrammar, matcher, prompt: list[int], ban=None):
        self.xgrammar = xgrammar  # xgrammar's matcher: the fills
        self.matcher = matcher  # its XGrammarMatcher (token checks, drafts), where drafting
        self.ban = ban  # the TokenBan ANDed into its rows, or None
        self.prompt = prompt
        self.outputs: list[int] = []  # the committed tokens accepted
        self.ngram = None  # prompt-lookup index, built on the first lookup


def main() -> None:
    from multiprocessing.connection import Client

    conn = Client(sys.argv[1], "AF_UNIX",
                  authkey=bytes.fromhex(os.environ.pop("GUIDED_SHARD_AUTHKEY")))
    try:
        serve(conn)
    finally:
        conn.close()
    # at once: the loader's queued compiles (seconds each) would otherwise run to the end
    # first, in a process nobody reads any more (an engine killed outright included)
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
