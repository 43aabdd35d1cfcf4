"""Sequential temperature scaling (STS) of the confidence head: one temperature per slot, fitted
on the held-out blocks so that the cumulative confidence product is calibrated (lowest ECE)."""

from __future__ import annotations

import math

import torch

STS_GRID = torch.exp(torch.linspace(math.log(0.05), math.log(20.0), 121))  # includes 1.0 (the middle)

ECE_BINS = 15


def ece(pred: torch.Tensor, target: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Expected calibration error with equal-width bins: sum_b (n_b / N) |mean pred_b - mean target_b|."""
    if pred.numel() == 0:
        return 0.0
    idx = (pred.clamp(0, 1) * bins).long().clamp(max=bins - 1)
    sp = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, pred.double())
    st = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, target.double())
    return float((sp - st).abs().sum() / pred.numel())


def fit_sts(conf_logit: torch.Tensor, cstar: torch.Tensor, valid: torch.Tensor, grid: torch.Tensor = STS_GRID,
            bins: int = ECE_BINS) -> dict:
    """Sequential temperature scaling: for slot j = 1..G in turn, the temperature T_j (from ``grid``)
    that minimises the ECE of prod_{i<=j} sigmoid(z_i / T_i) (earlier T_i fixed) against
    prod_{i<=j} c*_i, over the blocks whose slots 1..j have labels. Ties go to the temperature
    closest to 1. Returns ``temperatures`` [G] and the per-slot ``ece_before`` (all T = 1) /
    ``ece_after`` of the cumulative products."""
    nb, G = conf_logit.shape
    z = torch.nan_to_num(conf_logit.double())
    c = torch.nan_to_num(cstar.double())
    target = torch.where(valid, c, torch.zeros_like(c)).cumprod(1)
    raw = torch.sigmoid(z).cumprod(1)
    temps, before, after = [], [], []
    prev = torch.ones(nb, dtype=torch.float64)
    closeness = (grid.double().log()).abs()
    for j in range(G):
        v = valid[:, j]
        before.append(ece(raw[v, j], target[v, j], bins))
        if not bool(v.any()):
            temps.append(1.0)
            after.append(0.0)
            continue
        best, best_e = 1.0, None
        zs, ps, ts = z[v, j], prev[v], target[v, j]
        for T, cl in zip(grid.tolist(), closeness.tolist()):
            e = ece(ps * torch.sigmoid(zs / T), ts, bins)
            if best_e is None or e < best_e - 1e-12 or (abs(e - best_e) <= 1e-12 and cl < abs(math.log(best))):
                best, best_e = T, e
        temps.append(float(best))
        after.append(float(best_e))
        prev = prev * torch.sigmoid(z[:, j] / best)
    return {"temperatures": temps, "ece_before": before, "ece_after": after}
