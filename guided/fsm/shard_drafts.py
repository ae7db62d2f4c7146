"""The jump-forward half of the mask shards' work (guided/fsm/mask_shards.py): a request
mirrored in a shard has its next drafts walked there, on its mirror matcher, beside the step
loop, which only plans them (guided/engine/drafts.py) and waits for the replies before it schedules.
In the loop the walks cost 1.5 ms a step of the default model's host time at 64 requests and
2.9 ms at 256 on an H100's host (benchmarks/RESULTS.md, session 14). A shard that fails hands
its asks back: the loop's own matchers hold the same committed tokens."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from guided.fsm.mask_shards import _Shard

log = logging.getLogger(__name__)


class PendingDrafts:
    """The shards' proposals a step still waits for."""

    def __init__(self, shards: ShardDrafts, sent: list):
        self._shards = shards
        self._sent = sent  # (shard, seq, [(request, ask)] it walks)

    def wait(self) -> tuple[list[tuple], list[tuple]]:
        """Blocks for the replies: ([(request, (anchor, drafts, number forced))], the
        [(request, ask)] whose shard failed, to propose in-process)."""
        return self._shards._collect_drafts(self._sent)


class ShardDrafts:
    """MaskShards' drafting methods (its mirrors, shards, pipes and lock), and the opening of
    a mirror, which carries what drafting needs."""

    def _open(self, shard, request, mirror) -> bool:
        """The mirror goes with the shard's next message, with its ban (sent the first time:
        the shard ANDs it into the rows it fills) and, where the shard drafts, its prompt.
        False if the shard's pipe closed."""
        ban = getattr(request.matcher, "ban", None)
        key = None
        if ban is not None:
            key = id(ban.ids)
            self._bans[key] = ban.ids  # holds the ids, so that id() stays this ban's key
            if key not in shard.bans:
                try:
                    shard.conn.send(("ban", key, sorted(ban.ids)))
                except (OSError, ValueError):
                    self._fail(shard, "its pipe closed")
                    return False
                shard.bans.add(key)
        prompt = request.prompt_token_ids if shard.drafting else []
        shard.opens.append((request.request_id, mirror.gid, key, prompt))
        shard.loaded.move_to_end(mirror.gid)
        mirror.opened = True
        return True

    def ask_drafts(self, asks: list[tuple]) -> tuple[list[tuple], PendingDrafts | None]:
        """asks: (request, DraftAsk) of live constrained requests. Sends those mirrored in a
        ready shard to be walked there, beside the loop; returns (the asks to walk in-process,
        the replies to wait for). Their tokens are synced as for a fill."""
        try:
            return self._ask_drafts(asks)
        except Exception:  # noqa: BLE001 - a fault here must not fail the step
            log.exception("mask shards failed; grammar masks stay in-process")
            with self._lock:
                for shard in self._shards:
                    self._fail(shard, "asking for drafts failed")
            return asks, None

    def _ask_drafts(self, asks: list[tuple]) -> tuple[list[tuple], PendingDrafts | None]:
        with self._lock:
            if not self.drafting:
                return asks, None
            local: list[tuple] = []
            live = {shard for shard in self._live() if shard.drafting}
            per_shard: dict = {}  # shard -> (messages, [(request, ask)])
            for request, ask in asks:
                mirror = self._mirrors.get(request.request_id)
                # its first proposal: placed now, not at its first fill (a heavy request's rows
                # are filled on side threads, never mirrored)
                if mirror is None and live and not request.matcher.heavy:
                    mirror = self._mirrors[request.request_id] = self._place(
                        request.matcher, [s for s in self._shards if s in live])
                shard = None if mirror is None else mirror.shard
                if shard not in live or mirror.gid not in shard.loaded:
                    local.append((request, ask))
                    continue
                if not mirror.opened and not self._open(shard, request, mirror):
                    local.append((request, ask))
                    continue
                out = request.output_token_ids
                messages, mine = per_shard.setdefault(shard, ([], []))
                messages.append((request.request_id, out[mirror.synced:], ask.room,
                                 ask.lookup_tokens, ask.assumed))
                mine.append((request, ask))
                mirror.synced = len(out)
            sent = []
            for shard, (messages, mine) in per_shard.items():
                seq = self._send(shard, "drafts", messages)
                if seq is None:
                    local.extend(mine)
                    continue
                sent.append((shard, seq, mine))
            return local, PendingDrafts(self, sent) if sent else None

    def _collect_drafts(self, sent: list) -> tuple[list[tuple], list[tuple]]:
        done: list[tuple] = []
        failed: list[tuple] = []
        busiest = 0.0
        for shard, seq, mine in sent:
            reply = self._recv(shard, "drafts", seq)
            if reply is not None and reply[2] is None:
                with self._lock:
                    self._fail(shard, "its mirrors failed while drafting")
                reply = None
            if reply is None:
                failed.extend(mine)
                continue
            done.extend((request, result) for (request, _), result in zip(mine, reply[2]))
            busiest = max(busiest, reply[3])
        self._note_busy("shards: drafts, busiest (part)", busiest)
        return done, failed

    def _recv(self, shard: _Shard, kind: str, seq: int) -> tuple | None:
        """The reply to the message seq; a drafts reply nobody waited for (a step failed in
        between) is passed over. None: the shard failed."""
        while True:
            try:
                reply = shard.conn.recv()
            except (EOFError, OSError):
                reply = None
            if reply is not None and reply[0] == "drafts" and reply[1] != seq:
                continue
            if reply is None or reply[0] != kind or reply[1] != seq:
                with self._lock:
                    self._fail(shard, "no reply" if reply is None else "replied out of turn")
                return None
            return reply
