"""Prefix caching for drafters that read the target's features of every position (DSpark / DFlash).

A request whose prompt starts with cached KV blocks skips computing them (``block_manager``), but a
drafter with ``aux_layers`` also needs the target's features of those positions, which that skipped
forward would have produced. ``PrefixFeatures`` keeps them per full block, under the same chained
content hash the block manager registers the block's KV under: every sequence's features go into the
store as its positions are committed (prompt chunks and accepted tokens alike, a block at a time), and a
new request shares only the leading blocks whose features the store still holds; those features are
handed to the drafter as if the prefill had computed them. A position's features depend only on the
tokens up to it (and where the target's kernels give a row the same bits whatever rows travel with it,
as the CPU's do, on nothing else), so the drafter sees what it would have seen without sharing; they
only move drafts, never the output.

The store is bounded (``capacity`` positions, least recently used blocks dropped first); a sequence
holds back at most one unfinished block of its own.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from specserve.engine.block_manager import BlockManager

CAPACITY = 8192  # positions of features kept for later requests (a few MB a thousand positions)


class _Chain:
    """Where a sequence's stored features stand: the chained hash of its stored blocks, the position
    after them, and the features observed since (one list of per-layer tensors an observation)."""

    __slots__ = ("hash", "pos", "pending", "count")

    def __init__(self):
        self.hash, self.pos, self.pending, self.count = 0, 0, [], 0


class PrefixFeatures:
    """The features of recent sequences' full blocks by chained hash (``lookup``), filled as their
    positions are committed (``observe``); ``capacity`` positions at most."""

    def __init__(self, block_size: int, capacity: int = CAPACITY):
        self.block_size = block_size
        self.capacity = max(1, capacity // block_size)  # blocks
        self.blocks: OrderedDict[int, list[torch.Tensor]] = OrderedDict()  # chain hash -> per layer [bs, d]
        self.chains: dict[int, _Chain] = {}

    def lookup(self, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
        """The features of the leading full blocks of ``tokens`` that the store holds, never the block of
        the last token (as ``BlockManager.share_prefix``): (positions, per layer [positions, d])."""
        found = []
        for h in BlockManager.chain_hashes(tokens, self.block_size, (len(tokens) - 1) // self.block_size):
            f = self.blocks.get(h)
            if f is None:
                break
            self.blocks.move_to_end(h)
            found.append(f)
        if not found:
            return 0, []
        return len(found) * self.block_size, [torch.cat(layer) for layer in zip(*found)]

    def observe(self, seq, aux: list[torch.Tensor], reset: bool) -> None:
        """``aux`` (per layer [n, d]) are the features of the next n positions of ``seq`` (from 0 after
        ``reset``), whose tokens ``seq.all_ids`` already holds; every block they complete is stored."""
        chain = self.chains.get(seq.seq_id)
        if reset or chain is None:
            chain = self.chains[seq.seq_id] = _Chain()
        n = aux[0].shape[0] if aux else 0
        if not n:
            return
        chain.pending.append(aux)
        chain.count += n
        bs = self.block_size
        if chain.count < bs:
            return
        ids = seq.all_ids
        rows = [torch.cat(layer) if len(chain.pending) > 1 else layer[0] for layer in zip(*chain.pending)]
        done = 0
        while chain.count - done >= bs and chain.pos + bs <= len(ids):
            chain.hash = BlockManager.next_hash(chain.hash, ids[chain.pos : chain.pos + bs])
            self._put(chain.hash, [r[done : done + bs] for r in rows])
            chain.pos += bs
            done += bs
        chain.pending = [[r[done:] for r in rows]] if chain.count > done else []
        chain.count -= done

    def _put(self, h: int, features: list[torch.Tensor]) -> None:
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return
        self.blocks[h] = [f.clone() for f in features]  # not a view of a whole forward's output
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def forget(self, seq) -> None:
        self.chains.pop(seq.seq_id, None)
