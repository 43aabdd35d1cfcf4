"""The drafting loop of a block drafter: draft slots -> tokens left to right (base logits plus the
Markov bias, greedy or sampled with the exact corrected distribution kept), chains (``draft_blocks``)
or beam-searched candidate trees (``draft_trees``), and the confidences' calibration."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from specserve.layers import cpu_ops
from specserve.sample.sampler import inverse_cdf, uniforms
from specserve.spec_decode.dspark.config import d2t_from_t2d
from specserve.spec_decode.dspark.heads import ConfidenceHead, MarkovHead


class DraftBlock(NamedTuple):
    """One block's drafts. tokens [g] long (target ids); probs [g, V_target] float32, the exact
    distribution each token was sampled from (None: greedy, deterministic drafts); confidences [g]
    float32 (None without a confidence head)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None


@torch.no_grad()
def draft_blocks(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchors,
                 markov: MarkovHead | None = None, temperatures=None, generators=None,
                 d2t: torch.Tensor | None = None, *, confidence_head: ConfidenceHead | None = None,
                 target_vocab_size: int | None = None, num_drafts: int | None = None) -> DraftBlock:
    """Draft left to right from the draft slots' hidden states of a batch of blocks.

    base_logits_fn: hidden [..., d] -> base logits U [..., V_draft] (every slot of every row in one GEMM).
    hidden [B, g, d]: the draft slots (``DFlashDrafter.draft_hidden``). anchors [B]: each row's anchor
    target id, x_0. markov: None = pure DFlash (no bias). temperatures: None (all greedy) or one per
    row; a row with None or < 1e-5 is greedy (argmax of the corrected logits), else its x_k is sampled
    from ``softmax((U_k + B_k(x_{k-1})) / T)`` with ``generators[b]`` (same seed on every TP rank).
    d2t: draft->target offsets [V_draft] for a pruned vocabulary (then ``target_vocab_size`` is needed
    for q), or the bool ``t2d`` mask [V_target] itself: x_k is mapped to its target id before the next
    Markov lookup and in the output, and q_k is scattered into the target vocabulary.
    num_drafts: stop after that many positions.

    Returns tokens [B, g] (target ids), probs [B, g, V_target] (the exact q of sampled rows, zeros for
    greedy rows; None when every row is greedy), confidences [B, g] (None without a confidence head).
    """
    B = hidden.shape[0]
    g = hidden.shape[1] if num_drafts is None else max(0, min(int(num_drafts), hidden.shape[1]))
    hidden = hidden[:, :g]
    device = hidden.device
    temps = [None] * B if temperatures is None else list(temperatures)
    gens = [None] * B if generators is None else list(generators)
    sampled = [b for b in range(B) if temps[b] is not None and temps[b] >= 1e-5]
    if confidence_head is not None and confidence_head.with_markov and markov is None:
        raise ValueError("the confidence head reads W1[x_{k-1}] but there is no Markov head")
    if d2t is not None and d2t.dtype == torch.bool:  # a t2d mask
        target_vocab_size = target_vocab_size or d2t.numel()
    to_target = draft_target_ids(d2t, device)
    if to_target is not None and sampled and target_vocab_size is None:
        raise ValueError("a pruned draft vocabulary needs target_vocab_size to map q to the target vocabulary")
    prev = torch.as_tensor(anchors, device=device, dtype=torch.long).reshape(B)
    if g == 0:
        return DraftBlock(torch.zeros(B, 0, dtype=torch.long, device=device),
                          torch.zeros(B, 0, target_vocab_size or 0, device=device) if sampled else None,
                          None if confidence_head is None else torch.zeros(B, 0, device=device))
    base = base_logits_fn(hidden).float()  # [B, g, V_draft]
    tokens, probs, embs = [], [], []
    state, drafted = None, None
    if markov is None and not sampled:  # pure DFlash, greedy: no position depends on another's draft
        drafted = base.argmax(dim=-1)
        drafted = drafted if to_target is None else to_target[drafted]
    for k in range(0 if drafted is not None else g):
        logits = base[:, k]
        if markov is not None:
            bias, state, emb = markov.step(prev, hidden[:, k], state)
            logits = torch.add(logits, bias)  # float32 (bias promoted exactly)
            embs.append(emb)
        x = logits.argmax(dim=-1)
        if sampled:
            q = torch.zeros_like(logits)
            for b in sampled:
                q[b] = torch.softmax(logits[b] / temps[b], dim=-1)
                x[b] = inverse_cdf(q[b], uniforms(1, gens[b], q.device)[0])
            probs.append(q)
        if to_target is not None:
            x = to_target[x]
        tokens.append(x)
        prev = x
    confs = None
    if confidence_head is not None:  # c_k reads [h_k; W1[x_{k-1}]]: every position in one call
        confs = confidence_head(hidden, torch.stack(embs, dim=1) if embs else None).float()
    out_probs = None
    if sampled:
        q = torch.stack(probs, dim=1)  # [B, g, V_draft]
        if to_target is not None:
            full = q.new_zeros(B, g, target_vocab_size)
            full[..., to_target] = q
            q = full
        out_probs = q
    return DraftBlock(torch.stack(tokens, dim=1) if drafted is None else drafted, out_probs, confs)


_TARGET_IDS: dict = {}  # (id, version, device) of a d2t -> (that d2t, its target ids, then -1): made once a drafter


def draft_target_ids(d2t: torch.Tensor | None, device=None, with_empty: bool = False) -> torch.Tensor | None:
    """The target id of every draft id [V_draft] from ``d2t`` offsets or a bool ``t2d`` mask (None: the
    draft vocabulary is the target's), on ``device`` (default: ``d2t``'s); ``with_empty``: with -1 after
    them, so that index -1 (an empty place of a ``DraftTree``) maps to -1. Kept for the next call with the
    same, unchanged ``d2t`` (every drafting step asks): read it, never write it."""
    if d2t is None:
        return None
    device = d2t.device if device is None else torch.device(device)
    key = (id(d2t), d2t._version, str(device))
    hit = _TARGET_IDS.get(key)
    if hit is None or hit[0] is not d2t:
        offsets = d2t_from_t2d(d2t) if d2t.dtype == torch.bool else d2t
        ids = torch.arange(offsets.numel() + 1, device=device, dtype=torch.long)
        ids[:-1] += offsets.to(device=device, dtype=torch.long)
        ids[-1] = -1
        if len(_TARGET_IDS) >= 16:
            _TARGET_IDS.clear()
        hit = _TARGET_IDS[key] = (d2t, ids)
    return hit[1] if with_empty else hit[1][:-1]


def confidence_temperature_list(temperatures, g: int) -> list[float]:
    """The sequential-temperature-scaling divisor of each of ``g`` slots: ``temperatures[k]``, or 1 past
    the end of the list (or None) or for a non-positive entry."""
    return [float(x) if float(x) > 0 else 1.0 for x in (list(temperatures or []) + [1.0] * g)[:g]]


def calibrate_confidences(c: torch.Tensor, temperatures) -> torch.Tensor:
    """Confidences [..., g] after sequential temperature scaling: slot k's logit divided by
    ``temperatures[k]`` (``confidence_temperature_list``); float32."""
    c = c.float()
    if not temperatures:
        return c
    t = confidence_temperature_list(temperatures, c.shape[-1])
    return torch.sigmoid(torch.logit(c.clamp(1e-6, 1 - 1e-6)) / torch.tensor(t, device=c.device))


class DraftTree(NamedTuple):
    """Candidate nodes of a batch of draft trees (``draft_trees``); each row's root, its anchor, is not
    a candidate. tokens [B, C] target ids; parents [B, C] long: -1 for a child of the root, else the
    parent's candidate index, always smaller than the node's own (candidates come depth by depth);
    depth [C] long (1 = a child of the root; the same layout for every row); scores [B, C] float32:
    the estimated probability that the whole path root -> node is accepted (never above the
    parent's). A place of the layout below a node the search did not expand (``draft_trees``'
    ``min_score``) holds no node: token, parent and score -1."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor


@torch.no_grad()
def draft_trees(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchors,
                markov: MarkovHead | None = None, *, topk: int = 4, beam: int = 4, temperatures=None,
                confidence_head: ConfidenceHead | None = None, confidence_temperatures=None,
                d2t: torch.Tensor | None = None, num_drafts: int | None = None, min_score: float = 0.0) -> DraftTree:
    """Candidate draft trees from the draft slots of a batch of blocks, expanded best first.

    The block forward gives every depth k its base logits ``U_k`` once; a node's children come from
    ``U_k + B_k(x)``, the Markov bias of the node's OWN token x (and, for the rnn head, the state
    along its own path), so every branch is drafted as if it were the chain. Depth 1 holds the
    ``topk`` children of the root; each further depth holds the ``topk`` children of each of the
    ``beam`` best-scoring nodes of the depth before, of those scoring at least ``min_score`` only (a
    node's descendants never score above it: a cost model that verifies no node below some score
    needs none of them). The places of the nodes not expanded keep the layout, empty (``DraftTree``).

    A node's score is the product along its path of the probability that each step is accepted given
    its parent was: for a greedy row (temperature None or < 1e-5) with a confidence head, the
    (calibrated, ``confidence_temperatures`` one per depth) confidence ``c`` for the rank-0 child and
    ``(1 - c) * q_r / (1 - q_0)`` for rank r > 0 (the rest of the mass, shared as the draft
    distribution shares it); otherwise the draft probability ``q`` at the row's temperature (1 for
    greedy rows), the chance that the target's own draw is that token. The scores only choose which
    candidates are verified; verification is exact.

    On the CPU, a vanilla Markov head packed for it (``MarkovHead.pack_for_search``, which the drafting
    worker's ``fuse_projections`` does) has the whole search after the base logits run in one C++ call
    (``cpu_ops.tree_search``: every node's bias, softmax and top-k in one pass over W2, the depths and
    the beam inside); other heads, devices or an unpacked head take the loop below.
    """
    B = hidden.shape[0]
    g = hidden.shape[1] if num_drafts is None else max(0, min(int(num_drafts), hidden.shape[1]))
    hidden = hidden[:, :g]
    device = hidden.device
    if confidence_head is not None and confidence_head.with_markov and markov is None:
        raise ValueError("the confidence head reads W1[x_{k-1}] but there is no Markov head")
    if topk < 1 or beam < 1 or not min_score >= 0.0:
        raise ValueError(f"topk and beam must be >= 1 and min_score >= 0, got {topk}, {beam} and {min_score}")
    temps = [None] * B if temperatures is None else list(temperatures)
    is_greedy = [t is None or t < 1e-5 for t in temps]
    scale = greedy = None  # all rows greedy: no temperature division, no per-row choice of the factor
    if not all(is_greedy):
        scale = torch.tensor([1.0 if gr else float(t) for gr, t in zip(is_greedy, temps)], device=device).view(B, 1, 1)
        greedy = torch.tensor(is_greedy, device=device).view(B, 1, 1)
    ctemps = confidence_temperature_list(confidence_temperatures, g)
    prev = torch.as_tensor(anchors, device=device, dtype=torch.long).reshape(B, 1)
    base = base_logits_fn(hidden).float() if g else None  # [B, g, V_draft]
    pack = None if markov is None else markov.search_pack
    ops = cpu_ops.active() if g and pack is not None and device.type == "cpu" else None
    if ops is not None:  # the whole search in one C++ call (a vanilla head packed for it)
        return _tree_search(ops, pack, base, hidden, markov.prev_embeddings(prev.view(B)), confidence_head,
                            is_greedy, temps, ctemps, topk, beam, draft_target_ids(d2t, device, with_empty=True),
                            min_score)
    to_target = draft_target_ids(d2t, device)
    fscore = torch.ones(B, 1, device=device)
    fidx = torch.full((B, 1), -1, dtype=torch.long, device=device)
    state, toks, pars, scores, depth, offset = None, [], [], [], [], 0
    for k in range(g):
        W, V = prev.shape[1], base.shape[-1]
        kk = min(topk, V)
        h = hidden[:, k : k + 1].expand(B, W, hidden.shape[-1]).reshape(B * W, -1)
        bias, emb = None, None
        if markov is not None:  # (a place not expanded has token -1: any row will do, its children are dropped)
            bias, state, emb = markov.step(prev.reshape(-1).clamp_min(0), h, state)
            bias = bias.view(B, W, V)
        top_q, top_i = cpu_ops.softmax_topk(base[:, k], bias, scale, kk)
        top_q, top_i = top_q.expand(B, W, kk), top_i.expand(B, W, kk)  # no bias: every node's children alike
        factor = top_q  # [B, W, kk]
        if confidence_head is not None and any(is_greedy):
            # the calibrated confidence: sigmoid(logit / T_k) (sequential temperature scaling)
            c = torch.sigmoid(confidence_head.logits(h, emb).float().view(B, W, 1) / ctemps[k])
            rest = (1.0 - c) * top_q[..., 1:] / (1.0 - top_q[..., :1]).clamp_min(1e-6)
            factor = torch.cat([c, rest.clamp(max=1.0)], dim=-1)
            factor = factor if scale is None else torch.where(greedy, factor, top_q)
        child = (fscore.unsqueeze(-1) * factor).reshape(B, W * kk)
        tok = top_i.reshape(B, W * kk)
        tok = to_target[tok] if to_target is not None else tok
        par = fidx.unsqueeze(-1).expand(B, W, kk).reshape(B, W * kk)
        if k and min_score > 0.0:  # (the root is always expanded; no device sync to ask whether any is empty)
            empty = (fscore < min_score).unsqueeze(-1).expand(B, W, kk).reshape(B, W * kk)
            tok, par, child = tok.masked_fill(empty, -1), par.masked_fill(empty, -1), child.masked_fill(empty, -1.0)
        toks.append(tok)
        pars.append(par)
        scores.append(child)
        depth += [k + 1] * (W * kk)
        if k + 1 < g:  # the next depth expands this depth's best nodes
            fscore, j = child.topk(min(beam, W * kk), dim=-1)
            prev, fidx = tok.gather(1, j), offset + j
            if state is not None:  # rnn: a child continues its parent's state
                state = state.view(B, W, -1).gather(1, (j // kk).unsqueeze(-1).expand(-1, -1, state.shape[-1]))
                state = state.reshape(B * j.shape[1], -1)
        offset += W * kk
    if not toks:
        empty = torch.zeros(B, 0, dtype=torch.long, device=device)
        return DraftTree(empty, empty, torch.zeros(0, dtype=torch.long, device=device),
                         torch.zeros(B, 0, device=device))
    return DraftTree(torch.cat(toks, 1), torch.cat(pars, 1), torch.tensor(depth, dtype=torch.long, device=device),
                     torch.cat(scores, 1))


def _tree_search(ops, pack, base, hidden, anchor_emb, confidence_head, is_greedy, temps, ctemps, topk, beam,
                 to_target, min_score: float = 0.0) -> DraftTree:
    """``draft_trees``' search by ``cpu_ops.tree_search``: the same nodes in the same layout (a tie between
    two candidates goes to the lower draft id / node index), the scores to float32 rounding. ``to_target``:
    ``draft_target_ids(d2t, with_empty=True)``, or None."""
    B, g, d = hidden.shape
    w1d, w2p = pack
    t = torch.tensor([1.0 if gr else float(tp) for gr, tp in zip(is_greedy, temps)])
    conf_a = conf_we = None
    if confidence_head is not None:
        w_h, bias, conf_we = confidence_head.search_weights(w1d.shape[1])
        conf_a = torch.addmv(bias, hidden.reshape(B * g, d).float(), w_h).view(B, g)
    scored = [gr and confidence_head is not None for gr in is_greedy]
    tok, par, score = ops.tree_search(base, anchor_emb.float(), w1d, w2p, t, conf_a, conf_we, torch.tensor(scored),
                                      torch.tensor(ctemps, dtype=torch.float32), topk, beam, float(min_score))
    kk, W, depth = min(topk, base.shape[-1]), 1, []
    for k in range(g):
        depth += [k + 1] * (W * kk)
        W = min(beam, W * kk)
    if to_target is not None:  # (an empty place, -1, reads the table's last entry: -1)
        tok = to_target[tok]
    return DraftTree(tok, par, torch.tensor(depth, dtype=torch.long), score)


def draft_block(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchor,
                markov: MarkovHead | None = None, temperature: float | None = 0.0,
                generator: torch.Generator | None = None, d2t: torch.Tensor | None = None, *,
                confidence_head: ConfidenceHead | None = None, target_vocab_size: int | None = None,
                num_drafts: int | None = None) -> DraftBlock:
    """``draft_blocks`` for one block: hidden [g, d], anchor an int (or 0-d tensor), one temperature
    and generator -> tokens [g], probs [g, V_target] (None when greedy), confidences [g] or None."""
    anchor = torch.as_tensor(anchor, dtype=torch.long).reshape(1)
    out = draft_blocks(base_logits_fn, hidden.unsqueeze(0), anchor, markov, [temperature], [generator], d2t,
                       confidence_head=confidence_head, target_vocab_size=target_vocab_size, num_drafts=num_drafts)
    return DraftBlock(out.tokens[0], None if out.probs is None else out.probs[0],
                      None if out.confidences is None else out.confidences[0])

