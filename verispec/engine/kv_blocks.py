"""Paged KV blocks with prefix caching.

A full block is identified by a chained hash: hash(parent_hash, its token ids). The hash is
*published* (made findable by other requests) only once the step that writes the block's K/V has been
committed (a step that hits it runs after that one on the device); the scheduler calls publish() at commit
time, up to the request's num_computed_tokens and the tokens whose values it knew at launch. A
published block that is freed keeps its hash and can be revived until the allocator reuses it
(least recently freed first). Collisions are ruled out by comparing token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockManager:
    """Allocates fixed-size KV blocks to requests and keeps the prefix cache."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free: OrderedDict[int, None] = field(init=False)  # free block ids, oldest first
    cached: dict[int, int] = field(init=False)  # published hash -> block id
    num_hit_tokens: int = 0
    num_query_tokens: int = 0

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def lookup_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest published prefix of token_ids (never the whole sequence:
        at least one token must be computed to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = None
        limit = (len(token_ids) - 1) // self.block_size
        for i in range(limit):
            toks = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = self.chain_hash(parent, toks)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            found.append(bid)
            parent = h
        self.num_query_tokens += len(token_ids)
        self.num_hit_tokens += len(found) * self.block_size
        return found

    def take_cached(self, block_ids: list[int]) -> None:
        """Add a reference to prefix-hit blocks (reviving freed ones)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                self.free.pop(bid, None)
            blk.ref_count += 1

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free)

    def allocate(self, block_ids: list[int], num_tokens: int) -> bool:
        """Grow block_ids (in place) to hold num_tokens. False (and no change) if out of blocks."""
        need = -(-num_tokens // self.block_size) - len(block_ids)  # blocks_needed(), inlined: hot
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None:  # evict from the prefix cache
                if self.cached.get(blk.hash) == bid:
                    del self.cached[blk.hash]
                blk.hash, blk.token_ids = None, ()
            blk.ref_count = 1
            block_ids.append(bid)
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop a request's references; blocks reaching zero go to the back of the free list."""
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0, f"block {bid} freed twice"
            if blk.ref_count == 0:
                if blk.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # unhashed: reuse first
                else:
                    self.free[bid] = None
        block_ids.clear()

    def publish(self, block_ids: list[int], token_ids: list[int], num_written: int, first: int = 0) -> None:
        """Publish hashes of the full blocks whose K/V are written (the first num_written tokens).
        first > 0: blocks before it are published already and token_ids starts at block first."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.blocks[block_ids[first - 1]].hash if first else None
        for i in range(first, min(num_written // bs, len(block_ids))):
            blk = self.blocks[block_ids[i]]
            toks = tuple(token_ids[(i - first) * bs : (i - first + 1) * bs])
            if blk.hash is not None and blk.token_ids == toks:
                parent = blk.hash
                continue
            h = self.chain_hash(parent, toks)
            blk.hash, blk.token_ids = h, toks
            self.cached.setdefault(h, blk.block_id)
            parent = h
