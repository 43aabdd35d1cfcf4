"""Attention over the paged KV cache.

All attention metadata of one forward travels in a ``ForwardContext``: each row's block table, where
each new token's K/V is written (``write_idx``, a cache position, may differ from its RoPE position:
tree nodes of equal depth share a position but not a cache entry; -1 for padding: the scratch block),
how many cache positions the queries may see (``kv_len``) and the visibility mask. Truncating a
sequence is O(1): positions past its length are simply never visible, and are overwritten before any
query can see them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import cpu_ops


@dataclass
class ForwardContext:
    kv: object | None  # engine.kv_cache.KVCache, or None for a cache-free full-sequence forward
    tables: torch.Tensor | None = None  # long [B, blocks]: each row's block table (``KVCache.tables``)
    write_idx: torch.Tensor | None = None  # long [B, Q]: the cache position of each new token (-1: scratch)
    kv_len: int = 0  # positions [0, kv_len) are attended (masked by ``mask``)
    mask: torch.Tensor | None = None  # bool [B, 1, Q, kv_len], True = visible; None = all visible
    is_causal: bool = False  # with mask None: plain causal mask (prefill from position 0)
    positions_range: tuple[int, int] | None = None  # B == 1 and the RoPE positions are [a, b): no gather
    _masks: dict = field(default_factory=dict, repr=False)
    _targets: tuple | None = field(default=None, repr=False)

    def write_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [B*Q] each new token is written to (``KVCache.locate``), made once per forward."""
        if self._targets is None:
            self._targets = self.kv.locate(self.tables, self.write_idx)
        return self._targets

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as SDPA's additive mask in ``dtype`` (0 visible, -inf hidden), made once per forward
        and shared by the layers (given the bool mask, SDPA would convert it in every layer)."""
        if self.mask is None or self.mask.dtype != torch.bool:
            return self.mask
        m = self._masks.get(dtype)
        if m is None:
            m = self._masks[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return m


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.gqa = num_heads != num_kv_heads
        self.batch_invariant = False  # batch-invariant mode (``make_batch_invariant``): see ``forward``

    def _ops(self, q, mask):
        """The C++ ops where they apply to this forward (CPU, a head size of 8k, a bool mask), else None."""
        if q.device.type != "cpu" or self.head_dim % 8 or (mask is not None and mask.dtype != torch.bool):
            return None
        return cpu_ops.active()

    def forward(self, q, kv, ctx: ForwardContext, cache: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Q, H, D], kv [B, Q, 2, Hkv, D] (keys, values; views of the q/k/v projection do) ->
        [B, Q, H*D]. ``cache``: this layer's ``ctx.kv.kv[layer_idx]`` (found here when not given)."""
        B, Q = q.shape[:2]
        if cache is None and ctx.kv is not None:
            cache = ctx.kv.kv[self.layer_idx]
        if cache is None:
            src = kv.permute(0, 2, 3, 1, 4)  # [B, 2, Hkv, Q, D]
            causal = ctx.mask is None
        else:
            # one copy writes keys and values (pool layout [block, 2, Hkv, offset, D])
            blk, off = ctx.write_targets()
            cache[blk, :, :, off] = kv.reshape(B * Q, 2, self.num_kv_heads, self.head_dim)
            causal = ctx.is_causal
            if self.batch_invariant and (ops := self._ops(q, ctx.mask)) is not None:
                # the C++ op: each row's sums in one fixed order whatever shares the call (float32 for
                # bfloat16 where the AVX-512 BF16 kernel is built, else float64), no cast of the cache
                # (``specserve/csrc/cpu_ops.cpp``); the semantics of the branch below
                return ops.attention(q, cache, ctx.tables, ctx.kv_len, ctx.mask, causal, self.scale,
                                     cpu_ops.PARALLEL_WORK)
            src = ctx.kv.gather(cache, ctx.tables, ctx.kv_len)
        dtype = q.dtype
        q = q.transpose(1, 2)
        if self.batch_invariant:
            # Products of bfloat16 (or float32) values are exact in float64 and its sums err by ~1e-16:
            # the order in which a kernel adds them (which depends on the query count, the key count and,
            # in a tree, where a node's ancestors sit in the cache) no longer shows in the output once it
            # is rounded back to bfloat16 (steps of ~4e-3), short of a value within ~1e-16 of a tie.
            q, src = q.double(), src.double()  # keys and values in one cast
        keys, vals = src.unbind(1)
        out = F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=ctx.attn_mask(q.dtype), is_causal=causal, scale=self.scale, enable_gqa=self.gqa
        )
        return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format).reshape(B, Q, -1)
