"""Attention over the batched, slot-based KV cache.

All attention metadata of one forward travels in a ``ForwardContext``: which cache slots the batch
uses, where each new token's K/V is written (``write_idx``, may differ from its RoPE position: tree
nodes of equal depth share a position but not a cache entry), how many cache entries the queries may
see (``kv_len``) and the visibility mask. Truncating a sequence is O(1): entries past its length are
simply never visible, and are overwritten before any query can see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ForwardContext:
    kv: object | None  # engine.kv_cache.KVCache, or None for a cache-free full-sequence forward
    slot_start: int = 0
    write_idx: torch.Tensor | None = None  # [B, Q] cache index of each new token
    kv_len: int = 0  # keys [0, kv_len) are attended (masked by ``mask``)
    mask: torch.Tensor | None = None  # bool [B, 1, Q, kv_len], True = visible; None = all visible
    is_causal: bool = False  # with mask None: plain causal mask (prefill from position 0)
    flat_b: torch.Tensor | None = None  # [B*Q] batch index of each new token
    flat_w: torch.Tensor | None = None  # [B*Q] write_idx flattened
    write_range: tuple[int, int] | None = None  # B == 1 and the new tokens go to [a, b): slice writes


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.gqa = num_heads != num_kv_heads
        self.float64 = False  # batch-invariant mode (``make_batch_invariant``): see ``forward``

    def forward(self, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        """q [B, Q, H, D], k/v [B, Q, Hkv, D] -> [B, Q, H*D]."""
        B, Q = q.shape[:2]
        q = q.transpose(1, 2)
        if ctx.kv is None:
            keys, vals = k.transpose(1, 2), v.transpose(1, 2)
            mask, causal = ctx.mask, ctx.mask is None
        else:
            kc = ctx.kv.k[self.layer_idx][ctx.slot_start : ctx.slot_start + B]
            vc = ctx.kv.v[self.layer_idx][ctx.slot_start : ctx.slot_start + B]
            if ctx.write_range is not None:  # one sequence writing a contiguous range: a slice copy
                a, b = ctx.write_range
                kc[0, :, a:b] = k[0].transpose(0, 1)
                vc[0, :, a:b] = v[0].transpose(0, 1)
            else:
                kc[ctx.flat_b, :, ctx.flat_w] = k.reshape(B * Q, self.num_kv_heads, self.head_dim)
                vc[ctx.flat_b, :, ctx.flat_w] = v.reshape(B * Q, self.num_kv_heads, self.head_dim)
            keys, vals = kc[:, :, : ctx.kv_len], vc[:, :, : ctx.kv_len]
            mask, causal = ctx.mask, ctx.is_causal
        dtype = q.dtype
        if self.float64:
            # Products of bfloat16 (or float32) values are exact in float64 and its sums err by ~1e-16:
            # the order in which a kernel adds them (which depends on the query count, the key count and,
            # in a tree, where a node's ancestors sit in the cache) no longer shows in the output once it
            # is rounded back to bfloat16 (steps of ~4e-3), short of a value within ~1e-16 of a tie.
            q, keys, vals = q.double(), keys.double(), vals.double()
        out = F.scaled_dot_product_attention(
            q, keys, vals, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.gqa
        ).to(dtype)
        return out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim)
