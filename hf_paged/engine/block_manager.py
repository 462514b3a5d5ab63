"""Block manager with prefix caching: pure Python bookkeeping of the engine's KV pool (no tensors).

Each sequence owns its block table (``seq.block_table``, a list of block ids); this manager edits it.
A block is free or used. Full blocks whose tokens have been computed carry a chained hash of
``(parent hash, their token ids, extra key)``; a freed block keeps its hash, so the free list doubles
as the prefix cache. The free list is an ordered dict used as an LRU queue: blocks are taken from its
head; freed hashed blocks go to its tail (kept longest), freed unhashed blocks to its head (reused
first). A cached block is evicted (its hash forgotten) only when it is taken for new tokens.

Invariants (``check_invariants``):
- every block is free xor used: ``len(free) + used == num_blocks``;
- a block's refcount equals the number of sequence tables holding it (a table never holds one twice);
- ``hash_to_block`` and ``block_hash`` are inverse maps.
The scheduler asks before it acts (``blocks_needed`` / ``can_allocate``), so an allocation never
fails halfway and nothing needs rolling back. Copy-on-write is data: ``(src, dst)`` pairs for the cache.
"""
from __future__ import annotations

from collections import OrderedDict


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra: object = None) -> int:
    """Hash of a full block given its parent block's hash (None for the first block)."""
    return hash((parent, tokens, extra))


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` tokens; ``enable_prefix_caching`` turns hashing on."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, extra_key=None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.extra_key = enable_prefix_caching, extra_key
        self.refcounts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks   # verified on a hit
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.tables: dict[int, list[int]] = {}        # seq_id -> its block table (the same list object)
        self.evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks that can be taken now (cached-but-unused blocks included)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.free if self.block_hash[b] is not None)

    def match_prefix(self, token_ids: list[int], limit: int) -> tuple[list[int], list[int]]:
        """Cached full blocks that hold the first tokens of ``token_ids`` (at most ``limit`` tokens).

        Returns (block ids, their hashes); takes nothing. A hit is checked against the stored token ids.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs, blocks, hashes, parent = self.block_size, [], [], None
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

    def blocks_needed(self, table: list[int], num_computed: int, num_total: int, hits: list[int] = ()) -> int:
        """Free blocks needed so that ``table`` (plus ``hits``) covers ``num_total`` tokens when the first
        ``num_computed`` are stored: new blocks, one copy-on-write, and hit blocks now sitting in the free list."""
        bs = self.block_size
        have = len(table) + len(hits)
        new = max(0, -(-num_total // bs) - have)
        last = num_computed // bs
        cow = 1 if num_computed % bs and last < len(table) and self.refcounts[table[last]] > 1 else 0
        revived = sum(1 for b in hits if self.refcounts[b] == 0)
        return new + cow + revived

    # ------------------------------------------------------------- mutations
    def add_hits(self, seq_id: int, table: list[int], hits: list[int]) -> None:
        """Give an empty sequence the cached blocks ``hits`` (from ``match_prefix``)."""
        self.tables[seq_id] = table
        for block in hits:
            if self.refcounts[block] == 0:
                del self.free[block]
            self.refcounts[block] += 1
            table.append(block)

    def allocate(self, seq_id: int, table: list[int], num_computed: int, num_total: int,
                 copies: list[tuple[int, int]]) -> None:
        """Make ``table`` cover ``num_total`` tokens, of which the first ``num_computed`` are stored.

        A shared, partly filled block about to be written is replaced by a copy: ``(src, dst)`` goes to
        ``copies``. The caller checked ``blocks_needed <= num_free``.
        """
        self.tables[seq_id] = table
        bs = self.block_size
        last = num_computed // bs
        if num_computed % bs and last < len(table) and self.refcounts[table[last]] > 1:
            src = table[last]
            table[last] = self._take()
            self.refcounts[src] -= 1
            copies.append((src, table[last]))
        for _ in range(-(-num_total // bs) - len(table)):
            table.append(self._take())

    def fork(self, parent_id: int, child_id: int, child_table: list[int]) -> None:
        """``child_table`` shares every block of ``parent_id`` (refcounts + 1)."""
        for block in self.tables[parent_id]:
            self.refcounts[block] += 1
            child_table.append(block)
        self.tables[child_id] = child_table

    def commit(self, table: list[int], token_ids: list[int], num_computed: int, hashes: list[int]) -> None:
        """Hash the full, computed blocks of ``table`` past the ``len(hashes)`` already hashed, appending
        their chain hashes to ``hashes`` (the sequence's). A block whose hash another block already
        holds stays unregistered (the other one serves future hits)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_computed // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens, self.extra_key)
            block = table[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block], self.block_tokens[block] = h, tokens
                self.hash_to_block[h] = block
            hashes.append(h)
            parent = h

    def release(self, seq_id: int) -> None:
        """Drop ``seq_id``'s table; blocks no longer held go back to the free list (hashed ones to its tail)."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        refcounts, free = self.refcounts, self.free
        for block in reversed(table):       # a sequence's last blocks are evicted first
            refcounts[block] -= 1
            if refcounts[block] == 0:
                free[block] = None
                if self.block_hash[block] is None:
                    free.move_to_end(block, last=False)
        table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (used blocks keep theirs)."""
        for block in self.free:
            self._forget(block)

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (leaks, double frees, stale hashes)."""
        counts = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice"
            for block in table:
                counts[block] += 1
        assert counts == self.refcounts, "refcounts differ from the number of tables holding each block"
        used = {b for b, c in enumerate(counts) if c}
        assert not (used & self.free.keys()), "a block is both free and used"
        assert len(used) + len(self.free) == self.num_blocks, "blocks leaked: neither free nor used"
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"block {block} lost its hash"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), "stale block hashes"

    # -------------------------------------------------------------- internals
    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.block_hash[block] is not None:
            self.evictions += 1
            self._forget(block)
        self.refcounts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block] = self.block_tokens[block] = None
