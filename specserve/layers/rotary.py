"""Rotary position embedding (HF "rotate_half" layout), with llama3 and linear rope scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling), persistent=False)
        self._build(max(max_positions, 16))

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.int64, device=self.inv_freq.device).float()
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self._tables: dict[torch.dtype, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin for ``positions`` [..., Q] -> [..., Q, 1, head_dim] (broadcast over heads)."""
        need = int(positions.max()) + 1
        if need > self.cos_cached.shape[0]:
            self._build(max(need, 2 * self.cos_cached.shape[0]))
        cos = self.cos_cached[positions].to(dtype).unsqueeze(-2)
        sin = self.sin_cached[positions].to(dtype).unsqueeze(-2)
        return cos, sin

    def _table(self, need: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, 2, head_dim]: cos and ``rotate_``'s signed sin (first half negated) in ``dtype``, for
        positions [0, n) with n >= ``need``."""
        if need > self.cos_cached.shape[0]:
            self._build(max(need, 2 * self.cos_cached.shape[0]))
        tab = self._tables.get(dtype)
        if tab is None:
            half = self.head_dim // 2
            sin = torch.cat([-self.sin_cached[:, :half], self.sin_cached[:, half:]], dim=-1)
            tab = self._tables[dtype] = torch.stack([self.cos_cached, sin], dim=1).to(dtype)
        return tab

    def rotation(self, positions: torch.Tensor | tuple[int, int], dtype: torch.dtype):
        """What ``rotate_`` takes for ``positions`` (a [B, Q] tensor, or a range (a, b) shared by the
        batch): cos and signed sin, each [B or 1, Q, 1, head_dim], made once per forward for all layers."""
        if isinstance(positions, tuple):
            a, b = positions
            cos, sin = self._table(b, dtype)[a:b].unbind(1)
            return cos.view(1, b - a, 1, -1), sin.view(1, b - a, 1, -1)
        cos, sin = self._table(int(positions.max()) + 1, dtype)[positions].unbind(-2)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` in place on ``x`` [B, Q, heads, D], bit for bit, in four ops: with the halves
    of x swapped (``roll``) and the first half of ``sin`` negated (``RotaryEmbedding.rotation``),
    ``rotate_half(x) * sin`` is ``roll(x) * signed_sin`` exactly (negation is exact)."""
    swapped = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return x.mul_(cos).add_(swapped)
