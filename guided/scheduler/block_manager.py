"""Paged KV blocks: ref counts, a free queue in LRU order, and the prefix cache on top.

A block's key chains its parent's key with its token ids, so equal keys mean equal prefixes:

    prompt  [ t0..t15 ][ t16..t31 ][ t32..t40 ]
    keys      k0=h(-,b0) k1=h(k0,b1)  (partial: not cached)

Freed blocks keep their key and stay findable until reused ("cached, unreferenced"). Reuse takes
the least recently freed block; a request frees its blocks leaf first, so within one prefix the
leaves are evicted before their parents.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # prefix-cache key, set once the block is full and computed
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block_id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of token_ids, covering at most max_tokens."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        key = None
        bs = self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            key = hash((key, chunk))
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, block_ids: list[int], token_ids: list[int],
                             num_cached: int, num_full: int) -> int:
        """Give keys to blocks [num_cached, num_full) of a request; returns the new num_cached."""
        if not self.enable_prefix_caching:
            return num_full
        bs = self.block_size
        key = self.blocks[block_ids[num_cached - 1]].key if num_cached else None
        for i in range(num_cached, num_full):
            block = self.blocks[block_ids[i]]
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            key = hash((key, chunk))
            if block.key is None:
                block.key, block.token_ids = key, chunk
                self.cached.setdefault(key, block.block_id)
        return num_full

    # -- allocation ---------------------------------------------------------------------------
    def share(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def allocate(self, num: int) -> list[int]:
        if num > len(self.free_queue):
            raise MemoryError(f"asked for {num} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:  # evict: its cached content is overwritten from now on
                if self.cached.get(block.key) == block_id:
                    del self.cached[block.key]
                block.key, block.token_ids = None, ()
            block.ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # leaves first into the LRU queue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.key is None:  # nothing cached in it: reuse it before any cached block
                    self.free_queue.move_to_end(block_id, last=False)
