"""Held-out evaluation of a drafter: every anchor of every held-out sequence, teacher-forced, and the
acceptance figures that follow (per slot, cumulative, tau; greedy decoding replayed)."""

from __future__ import annotations

import torch

from specserve.train.common import progress_bar, replay_by_source
from specserve.train.data import DataError
from specserve.train.dspark.loss import anchor_range, block_outputs, collate, on_device, slot_weights, to_device


@torch.no_grad()
def evaluate_drafter(drafter, samples, feats, lm_w, lm_b, embed_w, *, gamma: int, mask_token_id: int,
                     loss_decay: float = 4.0, loss_w=(0.1, 0.9, 1.0), anchors_per_item: int = 32,
                     batch_size: int = 4, progress: bool = False, sources: tuple[list[int], list[str]] | None = None,
                     device: str = "cpu") -> dict:
    """Every anchor of every sequence (deterministic). Returns per-block arrays [nb, G] ``cstar``,
    ``conf_logit``, ``hit`` (float, NaN where the slot has no label), ``valid``; the mean ``loss``;
    the summaries of ``acceptance_summary``; ``lengths`` (blocks per sequence, in order) and
    ``decode``: greedy decoding with full verification replayed on the hits (``replay_by_source``;
    ``sources``: (sequences per source, source names), for its ``by_source``). ``device``: where the
    forwards run (``drafter`` ends on the device it came on; the results are on the CPU)."""
    with on_device(drafter, device) as dev:
        drafter.eval()
        lm_w, lm_b, embed_w = (None if t is None else t.to(dev) for t in (lm_w, lm_b, embed_w))
        items = []
        for i, s in enumerate(samples):
            lo, hi = anchor_range(s)
            for a in range(lo, hi, anchors_per_item):
                items.append((i, torch.arange(a, min(a + anchors_per_item, hi))))
        if not items:
            raise DataError("no held-out blocks: every held-out response is shorter than 2 tokens")
        sw = slot_weights(gamma, loss_decay).to(dev)
        cols = {k: [] for k in ("cstar", "conf_logit", "hit")}
        valid_all = []
        loss_sum, w_sum = 0.0, 0.0
        bar = progress_bar(len(items), "evaluate", progress)
        for b in range(0, len(items), batch_size):
            chunk = items[b : b + batch_size]
            batch = to_device(collate(chunk, samples, feats, gamma, mask_token_id), dev)
            out = block_outputs(drafter, batch, lm_w, lm_b, embed_w, sw, loss_w)
            valid = out["valid"].cpu()
            W = float(sw[out["slot"]].sum())
            loss_sum += float(out["loss"]) * W
            w_sum += W
            real = torch.zeros_like(valid[..., 0])  # [S, N] the non-padding blocks
            for r, (_, a) in enumerate(chunk):
                real[r, : len(a)] = True
            for k, name in (("cstar", "cstar"), ("conf_logit", "conf_logit"), ("hit", "hit")):
                full = torch.full(valid.shape, float("nan"))
                full[valid] = out[k].float().cpu()
                cols[name].append(full[real])
            valid_all.append(valid[real])
            if bar:
                bar.update(len(chunk))
        if bar:
            bar.close()
    res = {k: torch.cat(v) for k, v in cols.items()}
    res["valid"] = torch.cat(valid_all)
    res["loss"] = loss_sum / max(w_sum, 1e-9)
    res.update(acceptance_summary(res["cstar"], res["hit"], res["valid"]))
    res["lengths"] = [max(0, hi - lo) for lo, hi in map(anchor_range, samples)]  # rows per sequence
    sizes, names = sources or ([len(samples)], ["all"])
    res["decode"] = replay_by_source(torch.nan_to_num(res["hit"]) > 0.5, res["lengths"], sizes, names)
    return res


def acceptance_summary(cstar: torch.Tensor, hit: torch.Tensor, valid: torch.Tensor) -> dict:
    """From per-block [nb, G] arrays: ``acceptance`` [G] (mean c*_k: the acceptance probability of
    slot k given that slots < k were accepted), ``cumulative`` [G] (mean over blocks of
    prod_{i<=k} c*_i: the probability that the first k drafts are all accepted), ``tau`` (1 + sum of
    ``cumulative``: expected tokens per verification step, bonus token included), and the same for
    greedy verification of greedy drafts (``greedy_acceptance``, ``greedy_cumulative``,
    ``greedy_tau``; a hit = the draft's argmax equals the self-distilled label), ``blocks`` [G]."""
    n = valid.sum(0).clamp(min=1).double()
    c = torch.where(valid, cstar, torch.zeros_like(cstar)).double()
    h = torch.where(valid, hit, torch.zeros_like(hit)).double()
    cum_c, cum_h = c.cumprod(1), h.cumprod(1)
    acc = (c.sum(0) / n).tolist()
    cum = (cum_c.sum(0) / n).tolist()
    gacc = (h.sum(0) / n).tolist()
    gcum = (cum_h.sum(0) / n).tolist()
    return {"acceptance": acc, "cumulative": cum, "tau": 1.0 + sum(cum), "greedy_acceptance": gacc,
            "greedy_cumulative": gcum, "greedy_tau": 1.0 + sum(gcum), "blocks": [int(x) for x in valid.sum(0)]}
