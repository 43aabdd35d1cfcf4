"""KV cache blocks: which fixed-size block of the cache pool holds which positions of which sequence.

The pool is ``num_blocks`` blocks of ``block_size`` positions (``kv_cache.KVCache``); block 0 is the
scratch block that padding tokens write to and that pads the block tables of shorter rows. A running
sequence sits in a *slot* (0..max_slots-1, the batch row it decodes in) and owns the block table of
that slot: position ``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``.
Blocks are taken as a sequence grows and given back when it shrinks (rejected drafts), finishes or is
preempted, so the cache holds what the requests in flight need, nothing for idle slots.

Prefix caching: a full block of a sequence's committed tokens is registered under a hash of its
content chained with the blocks before it (``register``); a later sequence whose prompt starts with
the same blocks takes them (``share_prefix``: reference counts, no copy, no recomputation). A block
whose last user left stays cached, and is reused first-in first-out (least recently freed first) only
when no never-cached block is free. Shared blocks are never written: a sequence shares only blocks
before its last prompt token, writes go to positions past its shared prefix, and ``writable`` copies
a block that is shared or cached before anything is written into it (copy on write).

The manager is plain Python and deterministic: tensor-parallel ranks that receive the same calls hold
the same tables, so block ids never travel between processes.
"""

from __future__ import annotations

from collections import OrderedDict, deque

SCRATCH = 0  # the block padding tokens write to


class OutOfBlocks(RuntimeError):
    """No free block is left: the scheduler preempts or waits (never raised to a user)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_slots: int):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(1, num_blocks))  # never cached, or dropped from the cache
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # cached content, no user: reuse oldest first
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block -> content hash (registered blocks)
        self.by_hash: dict[int, int] = {}  # content hash -> block
        self.tables: list[list[int]] = [[] for _ in range(max_slots)]
        self.fresh: list[int] = []  # blocks handed out since the last ``take_fresh`` (the cache zeroes them)
        self._touched = bytearray(num_blocks)

    # ---- counts -----------------------------------------------------------------------------------
    def num_free(self) -> int:
        """Blocks a sequence can still take (free ones and cached ones nobody uses)."""
        return len(self.free) + len(self.cached_free)

    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free()

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def needed(self, slot: int, length: int) -> int:
        """Blocks ``slot`` must still take to hold ``length`` positions."""
        return max(0, self.blocks_for(length) - len(self.tables[slot]))

    # ---- taking and giving back ---------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            b = self.free.popleft()
        elif self.cached_free:
            b, _ = self.cached_free.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
        else:
            raise OutOfBlocks("no free KV cache block")
        self.ref[b] = 1
        if not self._touched[b]:
            self._touched[b] = 1
            self.fresh.append(b)
        return b

    def _give_back(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.cached_free[b] = None
            else:
                self.free.append(b)

    def take_fresh(self) -> list[int]:
        """Blocks never handed out before, since the last call (their memory holds no K/V yet)."""
        out, self.fresh = self.fresh, []
        return out

    def ensure(self, slot: int, length: int) -> None:
        """Blocks for positions [0, length) of ``slot``; blocks past them are given back (a sequence that
        shrank: rejected drafts). Raises ``OutOfBlocks`` (taking nothing) when too few are free."""
        table = self.tables[slot]
        n = self.blocks_for(length)
        while len(table) > n:
            self._give_back(table.pop())
        if n - len(table) > self.num_free():
            raise OutOfBlocks(f"slot {slot} needs {n - len(table)} blocks, {self.num_free()} free")
        while len(table) < n:
            table.append(self._take())

    def writable(self, slot: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make the blocks of positions [start, end) of ``slot`` its own (copy on write): returns the
        (source, copy) pairs whose contents the cache must copy before the write."""
        table, copies = self.tables[slot], []
        for i in range(start // self.block_size, min(self.blocks_for(end), len(table))):
            b = table[i]
            if self.ref[b] > 1 or b in self.hash_of:
                if self.ref[b] == 1:  # ours alone, only registered: unregister instead of copying
                    del self.by_hash[self.hash_of.pop(b)]
                    continue
                new = self._take()
                self._give_back(b)
                table[i] = new
                copies.append((b, new))
        return copies

    def release(self, slot: int) -> None:
        for b in reversed(self.tables[slot]):
            self._give_back(b)
        self.tables[slot] = []

    def release_all(self) -> None:
        for s in range(len(self.tables)):
            self.release(s)

    def move(self, src: int, dst: int) -> None:
        """The sequence in ``src`` now sits in ``dst`` (whose blocks are given back first)."""
        if src == dst:
            return
        self.release(dst)
        self.tables[dst], self.tables[src] = self.tables[src], []

    def swap(self, a: int, b: int) -> None:
        """The sequences in slots ``a`` and ``b`` trade places (either may be empty)."""
        self.tables[a], self.tables[b] = self.tables[b], self.tables[a]

    # ---- prefix caching -----------------------------------------------------------------------------
    @staticmethod
    def next_hash(h: int, block_tokens: list[int]) -> int:
        """The hash of a block holding ``block_tokens`` after the blocks whose chained hash is ``h`` (0:
        the first block)."""
        return hash((h, tuple(block_tokens)))

    @staticmethod
    def chain_hashes(tokens: list[int], block_size: int, full_blocks: int) -> list[int]:
        out, h = [], 0
        for i in range(full_blocks):
            h = BlockManager.next_hash(h, tokens[i * block_size : (i + 1) * block_size])
            out.append(h)
        return out

    def share_prefix(self, slot: int, tokens: list[int]) -> int:
        """Give the empty ``slot`` the cached blocks that hold a prefix of ``tokens`` (never the block of
        the last token: its logits are needed). Returns the number of positions shared."""
        if self.tables[slot]:
            raise ValueError(f"slot {slot} is not empty")
        full = (len(tokens) - 1) // self.block_size
        for h in self.chain_hashes(tokens, self.block_size, full):
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.cached_free[b]
            self.ref[b] += 1
            self.tables[slot].append(b)
        return len(self.tables[slot]) * self.block_size

    def register(self, slot: int, tokens: list[int], length: int) -> None:
        """Make the full blocks of ``slot`` within its first ``length`` positions (computed and final,
        holding ``tokens``) available to later sequences with the same prefix."""
        table = self.tables[slot]
        full = min(length // self.block_size, len(table))
        for b, h in zip(table[:full], self.chain_hashes(tokens, self.block_size, full)):
            if b in self.hash_of:
                continue
            if h not in self.by_hash:
                self.by_hash[h] = b
                self.hash_of[b] = h

    def check(self) -> None:
        """Consistency of the counts (tests): every block is free, cached-free or referenced."""
        users = [0] * self.num_blocks
        for t in self.tables:
            for b in t:
                users[b] += 1
        for b in range(1, self.num_blocks):
            in_free = (b in self.free) + (b in self.cached_free)
            assert users[b] == self.ref[b], (b, users[b], self.ref[b])
            assert (self.ref[b] == 0) == (in_free == 1), (b, self.ref[b], in_free)
        assert len(self.by_hash) == len(self.hash_of)
