"""Static-shape KV cache with one slot per running sequence.

Layout per layer: ``[num_slots, 2, kv_heads, capacity, head_dim]``, keys then values, so that one copy
writes both and one cast reads both (``Attention``); ``k[i]`` and ``v[i]`` are views of layer ``i``. The
running batch occupies slots ``0..B-1`` so that a decode step attends to a view, never a copy. Capacity
grows by doubling when a sequence needs more room; the last index is a scratch entry that padding
tokens write to.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers, num_slots, kv_heads, head_dim, dtype, device="cpu", capacity=256):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.kv: list[torch.Tensor] = []  # per layer [num_slots, 2, kv_heads, capacity, head_dim]
        self.k: list[torch.Tensor] = []  # views: kv[i][:, 0]
        self.v: list[torch.Tensor] = []  # views: kv[i][:, 1]
        self.ensure(capacity - 1)

    @property
    def scratch(self) -> int:
        return self.capacity - 1

    def _alloc(self, cap):
        return torch.zeros(self.num_slots, 2, self.kv_heads, cap, self.head_dim, dtype=self.dtype,
                           device=self.device)

    def ensure(self, needed: int) -> None:
        """Make room for cache indices [0, needed) plus the scratch entry."""
        if needed + 1 <= self.capacity:
            return
        cap = max(needed + 1, 2 * self.capacity, 64)
        cap = -(-cap // 64) * 64
        old = self.capacity - 1
        for i in range(self.num_layers):
            t = self._alloc(cap)
            if i < len(self.kv):
                t[..., :old, :] = self.kv[i][..., :old, :]
                self.kv[i] = t
            else:
                self.kv.append(t)
        self.k = [t[:, 0] for t in self.kv]
        self.v = [t[:, 1] for t in self.kv]
        self.capacity = cap

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
