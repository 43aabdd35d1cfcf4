"""Static-shape KV cache with one slot per running sequence.

Layout per layer: ``[num_slots, 2, kv_heads, capacity, head_dim]``, keys then values, so that one copy
writes both and one cast reads both (``Attention``); ``k[i]`` and ``v[i]`` are views of layer ``i``. The
running batch occupies slots ``0..B-1`` so that a decode step attends to a view, never a copy. Capacity
grows by doubling when a sequence needs more room, and slots are allocated as the running batch reaches
them (up to ``max_slots``): one long request costs one slot's memory whatever ``max_num_seqs`` allows.
The last index is a scratch entry that padding tokens write to.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers, max_slots, kv_heads, head_dim, dtype, device="cpu", capacity=256):
        self.num_layers, self.max_slots = num_layers, max_slots
        self.num_slots = 0  # allocated so far (``ensure``)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [num_slots, 2, kv_heads, capacity, head_dim]
        self.k: list[torch.Tensor] = []  # views: kv[i][:, 0]
        self.v: list[torch.Tensor] = []  # views: kv[i][:, 1]
        self.ensure(capacity - 1, 1)

    @property
    def scratch(self) -> int:
        return self.capacity - 1

    def ensure(self, needed: int, slots: int = 0) -> None:
        """Make room for cache indices [0, needed) plus the scratch entry, in slots [0, slots) at least
        (more slots: doubling, up to ``max_slots``)."""
        if slots > self.max_slots:
            raise ValueError(f"slot {slots - 1} is beyond the cache's {self.max_slots} slots")
        if needed + 1 <= self.capacity and slots <= self.num_slots:
            return
        cap = self.capacity
        if needed + 1 > cap:
            cap = -(-max(needed + 1, 2 * cap, 64) // 64) * 64
        n = self.num_slots if slots <= self.num_slots else min(self.max_slots, max(slots, 2 * self.num_slots))
        old_n, old = self.num_slots, self.capacity - 1
        for i in range(self.num_layers):
            t = torch.zeros(n, 2, self.kv_heads, cap, self.head_dim, dtype=self.dtype, device=self.device)
            if i < len(self.kv):
                t[:old_n, ..., :old, :] = self.kv[i][..., :old, :]
                self.kv[i] = t
            else:
                self.kv.append(t)
        self.k = [t[:, 0] for t in self.kv]
        self.v = [t[:, 1] for t in self.kv]
        self.capacity, self.num_slots = cap, n

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` entries of slot ``src`` into slot ``dst``."""
        for t in self.kv:
            t[dst, :, :, :length] = t[src, :, :, :length]

    def gather_into(self, slot: int, src_idx: torch.Tensor, dst_start: int) -> None:
        """Copy entries ``src_idx`` of ``slot`` to the contiguous range starting at ``dst_start``
        (tree verification keeps the accepted path only)."""
        n = src_idx.numel()
        for t in self.kv:
            t[slot, :, :, dst_start : dst_start + n] = t[slot, :, :, src_idx]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)
