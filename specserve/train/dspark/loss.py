"""The training objective: blocks drawn at anchor positions and collated into padded batches, the
drafter's slot states from its own forward, and DSpark's loss (per slot: CE against the label, TV
against the target's distribution, BCE of the confidence head against c* = 1 - TV, slot-weighted)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from specserve.train.dspark.drafter import draft_vocab_ids

IGNORE = -100


def anchor_range(sample: dict) -> tuple[int, int]:
    """[lo, hi) of the anchor positions of a sequence: response positions with a next token."""
    return max(int(sample["prompt_len"]), 1), len(sample["ids"]) - 1


def collate(items, samples, feats, gamma: int, mask_token_id: int, feats_dtype=torch.float32) -> dict:
    """items: [(sequence index, anchor positions [n])] -> the padded batch tensors: ``feats``
    [S, T, m*d] (``feats_dtype``), ``anchors`` [S, N], ``block_ids`` [S, N, G], ``labels`` [S, N, G] (IGNORE
    past the sequence end and for padding blocks), ``target_hidden`` [S, N, G, d] (the target's final
    hidden state at a+k, which predicts the label a+k+1) and, when ``feats[i]`` carries a third entry
(``target_lse``), ``target_lse`` [S, N, G]: the log-sum-exp of the target's logits there."""
    S = len(items)
    N = max(len(a) for _, a in items)
    T = max(len(samples[i]["ids"]) for i, _ in items)
    md = feats[items[0][0]][0].shape[1]
    d = feats[items[0][0]][1].shape[1]
    F_ = torch.zeros(S, T, md, dtype=feats_dtype)
    anchors = torch.zeros(S, N, dtype=torch.long)
    block_ids = torch.full((S, N, gamma), int(mask_token_id), dtype=torch.long)
    labels = torch.full((S, N, gamma), IGNORE, dtype=torch.long)
    tgt = torch.zeros(S, N, gamma, d)
    with_lse = len(feats[items[0][0]]) > 2
    lse = torch.zeros(S, N, gamma) if with_lse else None
    k = torch.arange(gamma)
    for r, (i, a) in enumerate(items):
        ids = torch.as_tensor(samples[i]["ids"], dtype=torch.long)
        aux, fin = feats[i][0], feats[i][1]
        Ti, n = len(ids), len(a)
        F_[r, :Ti] = aux
        a = torch.as_tensor(a, dtype=torch.long)
        anchors[r, :n] = a
        block_ids[r, :n, 0] = ids[a]
        pos = a.unsqueeze(1) + k + 1  # label positions [n, G]
        ok = pos < Ti
        lab = labels[r, :n]
        lab[ok] = ids[pos[ok]]
        th = tgt[r, :n]
        th[ok] = fin[pos[ok] - 1]
        if with_lse:
            lse[r, :n][ok] = feats[i][2][pos[ok] - 1]
    out = {"feats": F_, "anchors": anchors, "block_ids": block_ids, "labels": labels, "target_hidden": tgt}
    if with_lse:
        out["target_lse"] = lse
    return out


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device):
    """``module`` on ``device`` inside the block (yields it as a ``torch.device``), back where it came from after."""
    home = next(module.parameters()).device
    module.to(device)
    try:
        yield torch.device(device)
    finally:
        module.to(home)


def to_device(batch: dict, device) -> dict:
    """A collated batch on ``device`` (built on the CPU, where the features are kept)."""
    if str(device) == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def slot_states(drafter, batch: dict, embed_w: torch.Tensor) -> torch.Tensor:
    """The final-normed slot states [S, N, G, d] of a collated batch: the drafter's own training-shaped
    forward (``DFlashDrafter.forward_anchored_blocks``) over the blocks embedded with the target's frozen
    embedding ``embed_w`` [V, d]."""
    return drafter.forward_anchored_blocks(F.embedding(batch["block_ids"], embed_w), batch["anchors"], batch["feats"])


def block_outputs(drafter, batch: dict, lm_w, lm_b, embed_w, slot_w: torch.Tensor, loss_w=(0.1, 0.9, 1.0)) -> dict:
    """Forward + loss of a collated batch. Returns ``loss`` (the weighted mean over valid slots of
    ce_w*CE + tv_w*TV + conf_w*BCE), its parts ``ce``/``tv``/``bce`` (same weighting), and per valid
    slot (flat, in ``valid`` order): ``slot`` (0-based), ``cstar`` (1 - TV), ``conf_logit``, ``hit``
    (the draft's argmax equals the label), plus ``valid`` [S, N, G].

    A pruned drafter (own lm_head over a draft vocabulary) is scored in draft space: CE only where the
    label is in the draft vocabulary, and TV against the target distribution over the whole vocabulary
    (the draft puts no mass outside its vocabulary: that mass, 1 - sum of p over the draft rows, counts
    fully), from the draft rows of ``lm_w`` and the batch's ``target_lse``."""
    labels, block_ids = batch["labels"], batch["block_ids"]
    hidden = slot_states(drafter, batch, embed_w)  # [S, N, G, d]
    S, N, G, d = hidden.shape
    valid = labels != IGNORE
    prev = torch.cat([block_ids[..., :1], labels[..., :-1]], dim=-1).clamp(min=0)  # teacher forcing
    slot = torch.arange(G, device=labels.device).expand(S, N, G)[valid]
    hv, y, pv = hidden[valid], labels[valid], prev[valid]
    vocab_ids = draft_vocab_ids(drafter)
    logits, y_draft, emb = _draft_logits(drafter, hidden, valid, prev, (hv, y, pv), lm_w, lm_b, vocab_ids)
    p_t, outside = _target_probs(batch, valid, lm_w, lm_b, vocab_ids)
    logp = torch.log_softmax(logits, dim=-1)
    ce = F.nll_loss(logp, y_draft, reduction="none", ignore_index=IGNORE)
    tv = 0.5 * ((logp.exp() - p_t).abs().sum(-1) + outside)
    cstar = (1.0 - tv).detach().clamp(0.0, 1.0)
    ch = drafter.confidence_head
    if ch is not None:
        conf_logit = ch.logits(hv, emb if ch.with_markov else None).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, cstar, reduction="none")
    else:
        conf_logit = torch.zeros_like(cstar)
        bce = torch.zeros_like(cstar)
    w = slot_w[slot]
    W = w.sum().clamp(min=1e-9)
    ce_m, tv_m, bce_m = (w * ce).sum() / W, (w * tv).sum() / W, (w * bce).sum() / W
    loss = loss_w[0] * ce_m + loss_w[1] * tv_m + loss_w[2] * bce_m
    return {"loss": loss, "ce": ce_m.detach(), "tv": tv_m.detach(), "bce": bce_m.detach(), "slot": slot,
            "cstar": cstar, "conf_logit": conf_logit.detach(),
            "hit": (_to_target(logits.argmax(-1), vocab_ids) == y).detach(), "valid": valid}


def _draft_logits(drafter, hidden, valid, prev, flat, lm_w, lm_b, vocab_ids):
    """The valid slots' draft logits (float32, over the draft vocabulary, Markov bias added with the
    teacher-forced previous tokens ``prev``), their labels in draft ids (IGNORE outside the draft
    vocabulary) and the Markov head's W1[x_{k-1}] (None without one). ``flat``: the valid slots' states,
    labels and previous tokens."""
    S, N, G, d = hidden.shape
    hv, y, pv = flat
    if vocab_ids is None:
        logits = F.linear(hv, lm_w, lm_b).float()
        y_draft = y
    else:
        logits = F.linear(hv, drafter.lm_head.weight).float()
        t2d = torch.full((lm_w.shape[0],), IGNORE, dtype=torch.long, device=vocab_ids.device)
        t2d[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
        y_draft = t2d[y]
    mk = drafter.markov_head
    emb = None
    if mk is not None:
        if mk.head_type == "rnn":  # the state runs over the whole block
            b = mk.bias(prev.view(S * N, G), hidden.view(S * N, G, d)).view(S, N, G, -1)[valid]
        else:
            b = mk.bias(pv, hv)
        logits = logits + b.float()
        emb = mk.prev_embeddings(pv)
    return logits, y_draft, emb


@torch.no_grad()
def _target_probs(batch: dict, valid, lm_w, lm_b, vocab_ids):
    """The target's probabilities over the draft vocabulary at the valid slots and, for a pruned one, the
    mass it puts outside it (0.0 for the whole vocabulary)."""
    if vocab_ids is None:
        p_t = torch.softmax(F.linear(batch["target_hidden"][valid], lm_w, lm_b).float(), dim=-1)
        return p_t, 0.0
    lt = F.linear(batch["target_hidden"][valid], lm_w[vocab_ids], None if lm_b is None else lm_b[vocab_ids])
    p_t = torch.exp(lt.float() - batch["target_lse"][valid].unsqueeze(-1))
    return p_t, (1.0 - p_t.sum(-1)).clamp(min=0.0)


def _to_target(draft_ids: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    return draft_ids if vocab_ids is None else vocab_ids[draft_ids]


def slot_weights(gamma: int, decay: float = 4.0) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for slot k = 1..gamma."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / decay)
