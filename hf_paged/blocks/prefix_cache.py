"""Prefix caching on top of a block pool: full blocks identified by a chained hash of their tokens.

A full, computed block gets ``hash((parent hash, its token ids, extra key))``. When its last holder
releases it, it stays kept in the pool (at the tail of the free queue) with its hash, so a later
sequence that starts with the same tokens takes it back instead of recomputing it; it is evicted
(hash forgotten) only when the pool hands it out for new tokens. Every hit is checked against the
stored token ids, so a hash collision can never serve wrong KV.

Invariant (``check_invariants``): ``hash_to_block`` and ``block_hash`` are inverse maps.
"""
from __future__ import annotations

from .pool import BlockPool
from .table import BlockTable


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra: object = None) -> int:
    """Hash of a full block given its parent block's hash (None for the first block)."""
    return hash((parent, tokens, extra))


class PrefixCache:
    """The hashes of ``pool``'s full blocks. ``extra_key`` separates caches that must never share
    (for example another model or KV dtype in the same process)."""

    def __init__(self, pool: BlockPool, extra_key=None):
        self.pool, self.extra_key = pool, extra_key
        self.block_hash: list[int | None] = [None] * pool.num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * pool.num_blocks
        self.hash_to_block: dict[int, int] = {}
        if pool.keeper is not None:
            raise ValueError("this block pool already has a keeper")
        pool.keeper = self

    @property
    def num_hashed(self) -> int:
        """Blocks that carry a hash, held or free."""
        return len(self.hash_to_block)

    def keeps(self, block: int) -> bool:
        """Pool keeper: a released block with a hash stays kept for future hits."""
        return self.block_hash[block] is not None

    def evicted(self, block: int) -> None:
        """Pool keeper: ``block`` was handed out for new tokens; its hash is forgotten."""
        h = self.block_hash[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block] = self.block_tokens[block] = None

    def forget_all(self) -> None:
        """Forget every block's hash (their K/V no longer match their tokens: the model's weights changed);
        kept free blocks become plain free blocks."""
        for block in list(self.hash_to_block.values()):
            self.evicted(block)
            self.pool.forget(block)

    def match(self, token_ids: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Cached full blocks holding the first tokens of ``token_ids`` (at most ``limit`` tokens).

        Returns (block ids, their chain hashes); takes nothing.
        """
        bs, blocks, hashes, parent = self.pool.block_size, [], [], None
        for start in range(0, limit - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            h = chain_hash(parent, tokens, self.extra_key)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def blocks_to_revive(self, hits: list[int]) -> int:
        """How many of ``hits`` sit in the free queue (taking them back uses free blocks)."""
        return sum(1 for b in hits if self.pool.refcounts[b] == 0)

    def table_from_hits(self, hits: list[int]) -> BlockTable:
        """A table holding the cached blocks ``hits`` (from ``match``), their tokens counted as stored."""
        for block in hits:
            self.pool.hold(block)
        return BlockTable(list(hits), len(hits) * self.pool.block_size)

    def commit(self, table: BlockTable, token_ids: list[int], hashes: list[int]) -> None:
        """Hash the full blocks of ``table`` past the ``len(hashes)`` already hashed; append their chain
        hashes to ``hashes`` (the sequence's). ``token_ids[:table.num_tokens]`` must be stored. A block
        whose hash another block already carries stays unhashed (the other one serves future hits)."""
        bs = self.pool.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), table.num_tokens // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens, self.extra_key)
            block = table.blocks[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block], self.block_tokens[block] = h, tokens
                self.hash_to_block[h] = block
            hashes.append(h)
            parent = h

    def check_invariants(self) -> None:
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"block {block} lost its hash"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), "stale block hashes"
        for block in range(self.pool.num_blocks):
            if self.pool.is_kept(block):
                assert self.block_hash[block] is not None, f"kept block {block} has no hash"
