from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as HF Llama/Qwen do). On a bfloat16
    (float16) input ``F.rms_norm`` itself computes in float32 and rounds once at the end, which is
    ``F.rms_norm(x.float()).to(x.dtype)`` without the two casts."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` over the last dim of ``x`` [..., n, D] with a weight per row of the last two dims
    (``weight`` [n, D], e.g. the q_norm weight for the query heads stacked over the k_norm weight for the
    key heads): several norms of the same size in one call. Float32 inside, as ``RMSNorm``."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    return weight * F.rms_norm(x, weight.shape[-1:], None, eps)
