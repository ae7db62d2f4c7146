"""The grammar half of the mask shards' bookkeeping (guided/fsm/mask_shards.py): where a
request's mirror is placed, which grammars each shard holds, and sending them there (as the
recipe the engine compiled each from: the shard compiles its own copy beside its fills)."""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guided.fsm.mask_shards import _Shard

log = logging.getLogger(__name__)

# larger compiled grammars stay in-process: a shard's compile of its copy takes as long as the
# engine's (tens of seconds of a core at this size); the costly rows (a random 8B model's long
# strings) are often theirs
MAX_SHIPPED_BYTES = 32 << 20
CACHED_GRAMMARS = 256  # unused grammars a shard keeps loaded for the next request
PLACEMENT_SLACK = 16  # see _place


@dataclass(slots=True, eq=False)
class _Mirror:
    shard: _Shard | None  # None: filled in-process for good
    gid: int
    opened: bool = False
    synced: int = 0  # output tokens the mirror has accepted


class ShardGrammars:
    """MaskShards' methods for mirrors and grammars (its shards, files, gids and lock)."""

    def release(self, request_id: str) -> None:
        """The request finished: its mirror goes with the shard's next step message."""
        with self._lock:
            mirror = self._mirrors.pop(request_id, None)
            shard = None if mirror is None else mirror.shard
            if shard is None or shard.dead:
                return
            shard.num_mirrors -= 1
            shard.users[mirror.gid] -= 1
            if mirror.opened:
                shard.closes.append(request_id)
            self._evict(shard)

    def _place(self, matcher, live: list[_Shard]) -> _Mirror:
        compiled = getattr(matcher, "compiled", None)
        recipe = getattr(matcher, "recipe", None)
        if compiled is None or recipe is None:  # not an xgrammar matcher: nothing to send
            return _Mirror(None, -1)
        known = self._gids.get(id(compiled))
        if known is not None and known[0]() is compiled:
            gid = known[1]
        else:  # CompiledGrammar is unhashable: keyed by id, kept while the grammar lives
            gid = self._next_gid
            self._next_gid += 1
            key = id(compiled)
            self._gids[key] = (weakref.ref(compiled, lambda _, k=key: self._gids.pop(k, None)),
                               gid)
        if gid in self._unshippable or compiled.memory_size_bytes > self.max_shipped_bytes:
            if gid not in self._unshippable:
                log.info("mask shards: a %.1f MB grammar stays in-process",
                         compiled.memory_size_bytes / 2**20)
                self._unshippable.add(gid)
            return _Mirror(None, gid)
        # where the grammar is (being) loaded, unless that shard is far busier than the
        # emptiest: a row filled in-process while a grammar compiles costs more than imbalance
        best = min(live, key=lambda s: s.num_mirrors)
        having = [s for s in live if gid in s.loaded or gid in s.loading]
        if having:
            closest = min(having, key=lambda s: s.num_mirrors)
            if closest.num_mirrors <= 2 * best.num_mirrors + PLACEMENT_SLACK:
                best = closest
        if gid not in best.loaded and gid not in best.loading:
            try:
                best.conn.send(("load", gid, tuple(recipe)))
            except (OSError, ValueError):
                self._fail(best, "its pipe closed")
                return _Mirror(None, gid)
            best.loading.add(gid)
        best.num_mirrors += 1
        best.users[gid] += 1
        return _Mirror(best, gid)

    def _evict(self, shard: _Shard) -> None:
        unused = [gid for gid in shard.loaded if shard.users[gid] <= 0]
        for gid in unused[:max(0, len(unused) - CACHED_GRAMMARS)]:
            del shard.loaded[gid]
            del shard.users[gid]
            try:
                shard.conn.send(("drop", gid))
            except (OSError, ValueError):
                self._fail(shard, "its pipe closed")
                return
