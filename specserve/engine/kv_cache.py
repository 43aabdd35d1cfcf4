"""Paged KV cache: a pool of fixed-size blocks per layer, addressed through block tables.

Layout per layer: ``[num_blocks, 2, kv_heads, block_size, head_dim]``, keys then values, so that one
copy writes both; the layers are views of one pool ``[layers, num_blocks, ...]``, so that one op moves
a block or a position in every layer. ``BlockManager`` decides which block holds which positions of
which sequence (block 0: the scratch block that padding tokens write to). A forward gives every row
its table as a tensor ``[B, max blocks]`` (shorter rows padded with the scratch block) and every new
token a (block, offset) to write to; attention reads keys through the tables (``Attention``, the C++
``attention``).

The pool is reserved (``torch.empty``) and its pages become resident as blocks are first used, each
zeroed then: memory follows the tokens in flight, up to the budget the engine sets at start-up.
"""

from __future__ import annotations

import torch

from specserve.engine.block_manager import SCRATCH, BlockManager, OutOfBlocks

BLOCK_SIZE = 16  # positions per block


class KVCache:
    def __init__(self, num_layers, max_slots, kv_heads, head_dim, dtype, device="cpu", num_blocks: int = 1024,
                 block_size: int = BLOCK_SIZE):
        self.num_layers, self.max_slots = num_layers, max_slots
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, max_slots)
        # [layers, num_blocks, 2, kv_heads, block_size, head_dim]; pages resident once a block is used
        self.pool = torch.empty(num_layers, num_blocks, 2, kv_heads, block_size, head_dim, dtype=dtype, device=device)
        self.kv = list(self.pool.unbind(0))  # per layer [num_blocks, 2, kv_heads, block_size, head_dim]
        self.pool[:, SCRATCH].zero_()

    @staticmethod
    def bytes_per_block(num_layers, kv_heads, head_dim, dtype, block_size: int = BLOCK_SIZE) -> int:
        return num_layers * 2 * kv_heads * block_size * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.block_size)

    def _zero_fresh(self) -> None:
        fresh = self.blocks.take_fresh()
        if fresh:  # never-written memory may hold anything (NaN): attention multiplies hidden keys by 0
            self.pool.index_fill_(1, torch.tensor(fresh, dtype=torch.long, device=self.device), 0)

    def prepare(self, slot_start: int, starts: list[int], lens: list[int]) -> None:
        """Blocks for every row's positions [0, start + len), its own for [start, start + len) (copy
        on write), blocks past them given back. Raises ``OutOfBlocks`` before changing anything when
        too few are free."""
        bm = self.blocks
        need = sum(bm.needed(slot_start + b, s + n) for b, (s, n) in enumerate(zip(starts, lens)))
        if need > bm.num_free():
            raise OutOfBlocks(f"{need} blocks needed, {bm.num_free()} free")
        copies = []
        for b, (s, n) in enumerate(zip(starts, lens)):
            bm.ensure(slot_start + b, s + n)
            copies += bm.writable(slot_start + b, s, s + n)
        self._zero_fresh()
        for src, dst in copies:
            self.pool[:, dst] = self.pool[:, src]

    def tables(self, slot_start: int, B: int, kv_len: int) -> torch.Tensor:
        """The block tables of rows ``slot_start .. + B`` over positions [0, kv_len): long [B, blocks]."""
        nb = max(1, -(-kv_len // self.block_size))
        if B == 1 and len(self.blocks.tables[slot_start]) >= nb:  # decoding one sequence: no padding
            return torch.tensor([self.blocks.tables[slot_start][:nb]], dtype=torch.long, device=self.device)
        out = torch.full((B, nb), SCRATCH, dtype=torch.long)
        for b in range(B):
            t = self.blocks.tables[slot_start + b][:nb]
            if t:
                out[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        return out.to(self.device)

    def locate(self, tables: torch.Tensor, widx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each cache position ``widx`` [B, Q] (-1: the scratch entry), flattened."""
        bs = self.block_size
        w = widx.clamp(min=0)
        blk = torch.gather(tables, 1, (w // bs).clamp(max=tables.shape[1] - 1))
        blk = torch.where(widx < 0, SCRATCH, blk)
        off = torch.where(widx < 0, 0, w % bs)
        return blk.reshape(-1), off.reshape(-1)

    def gather(self, layer_cache: torch.Tensor, tables: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Keys and values of positions [0, kv_len) of each row, contiguous: [B, 2, kv_heads, kv_len, D]."""
        B, nb = tables.shape
        src = layer_cache[tables]  # [B, nb, 2, Hkv, bs, D]
        src = src.permute(0, 2, 3, 1, 4, 5).reshape(B, 2, self.kv_heads, nb * self.block_size, self.head_dim)
        return src[:, :, :, :kv_len]

    def sequence(self, slot: int, layer: int, length: int) -> torch.Tensor:
        """Keys and values of positions [0, length) of ``slot`` in ``layer``: [2, kv_heads, length, D]."""
        return self.gather(self.kv[layer], self.tables(slot, 1, length), length)[0]

    def move(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` now decodes in slot ``dst`` (a table move, no copy)."""
        self.blocks.move(src, dst)

    def release(self, slot: int) -> None:
        self.blocks.release(slot)

    def gather_into(self, slot: int, src_idx: list[int], dst_start: int) -> None:
        """Copy positions ``src_idx`` of ``slot`` to the positions from ``dst_start`` on, in every layer
        (tree verification keeps the accepted path only: ``src_idx`` increasing, each at or after its
        destination, every position the slot's own). A position already in place is not copied."""
        table, bs = self.blocks.tables[slot], self.block_size
        for i, src in enumerate(src_idx):
            dst = dst_start + i
            if src < dst or (i and src <= src_idx[i - 1]):
                raise ValueError(f"gather_into: positions {src_idx} do not move down to {dst_start} in order")
            if src != dst:  # in order: a later source sits past every earlier destination
                self.pool[:, table[dst // bs], :, :, dst % bs] = self.pool[:, table[src // bs], :, :, src % bs]
