from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import cpu_ops


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
        if (ops := _bf16_norm_op(x, self.weight)) is not None:  # the same bits in one C++ call
            return ops.rms_norm(x, self.weight, self.eps, cpu_ops.norm_vec_width())
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)


def _bf16_norm_op(x: torch.Tensor, weight: torch.Tensor):
    """The C++ ops (``cpu_ops``) where they compute this norm: bfloat16 on the CPU, nothing to differentiate
    (``cpu_ops.rms_norm`` reproduces ``weight * F.rms_norm(x)`` bit for bit: ``cpu_ops.norm_vec_width``)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    return cpu_ops.active()


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` over the last dim of ``x`` [..., n, D] with a weight per row of the last two dims
    (``weight`` [n, D], e.g. the q_norm weight for the query heads stacked over the k_norm weight for the
    key heads): several norms of the same size in one call. Float32 inside, as ``RMSNorm`` (bfloat16 rows
    on the CPU through the C++ norm op, the same bits)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape[-1:], None, eps) * weight
    if (ops := _bf16_norm_op(x, weight)) is not None:
        return ops.rms_norm(x, weight, eps, cpu_ops.norm_vec_width())
    return weight * F.rms_norm(x, weight.shape[-1:], None, eps)


def stack_head_norms(q_norm: RMSNorm, num_q_heads: int, k_norm: RMSNorm, num_kv_heads: int) -> torch.Tensor:
    """The weight ``rms_norm_heads`` takes for the q and k heads side by side: ``q_norm``'s for each of the
    query heads stacked over ``k_norm``'s for each key head, [num_q_heads + num_kv_heads, D]."""
    D = q_norm.weight.shape[0]
    return torch.cat([q_norm.weight.data.expand(num_q_heads, D), k_norm.weight.data.expand(num_kv_heads, D)])
