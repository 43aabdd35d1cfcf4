"""Lossless verification of a chain of draft tokens (the semantics of vLLM V1's rejection sampler).

Each sequence ``b`` brings ``k_b`` draft tokens ``x_0 .. x_{k_b-1}`` (``k_b`` may be 0) and the
target model's logits at ``k_b + 1`` positions: position ``j`` scores the token that follows draft
``j - 1`` (position 0 scores the token after the last verified token), and position ``k_b`` is the
*bonus* position, scored after every draft was accepted.

Greedy rows (``SamplingParams.greedy``): drafts are accepted while they equal the argmax of the
target logits; the first mismatch emits that argmax (the *recovered* token) and stops; when every
draft matched, the argmax at position ``k_b`` (the bonus) is appended. The result is exactly what
plain greedy decoding produces, token for token.

Random rows: ``p`` is the distribution plain sampling draws from, ``softmax(filtered_logits(...))``
(temperature, top-k, top-p, min-p exactly as :mod:`specserve.sample.sampler` applies them).

* With draft probabilities ``q`` (the drafts were sampled from ``q``): draft ``x`` is accepted iff
  ``u < p(x) / q(x)`` with ``u ~ U[0, 1)`` (``q(x) == 0`` is always a rejection); on rejection the
  recovered token is a sample of ``norm(max(p - q, 0))`` (``p`` itself if that is all zero). The
  emitted token is then an exact sample of ``p``: ``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y
  min(p(y), q(y))) * max(p(x) - q(x), 0) / sum_y max(p(y) - q(y), 0) = p(x)``.
* Without draft probabilities (deterministic drafts, e.g. n-gram or Medusa argmax heads; the draft is
  one-hot, ``q(x) = 1``): ``x`` is accepted with probability ``p(x)``; on rejection the recovered
  token is a sample of ``p`` with ``x`` zeroed. ``P(x) = p(x)`` and ``P(y != x) = (1 - p(x)) p(y) /
  (1 - p(x)) = p(y)``.

After the first rejection nothing more is emitted for the row; if every draft was accepted the bonus
token is sampled from ``p`` at position ``k_b``. A draft id that is negative or ``>= V`` is treated
as a token of probability 0 (always rejected) and never used as an index.

Randomness: every random row draws, from its own ``sb.generators[b]``, ``k_b`` uniforms and then one
more, with which the recovered or the bonus token is drawn by inverse CDF (only one of the two is ever
emitted, and whether a rejection happened depends on the first ``k_b`` uniforms only, so sharing the
last one between them is exact). The amount drawn does not depend on the outcome or on the rest of the
batch, so a seeded request gets the same tokens whatever it is batched with. Greedy rows draw nothing.

Output: int64 ``[B, max_k + 1]`` (``max_k + 1 = target_logits.shape[1]``) holding, per row, the
accepted drafts followed by one recovered or bonus token, padded with ``PLACEHOLDER`` (-1).
"""

from __future__ import annotations

import torch

from specserve.sample.sampler import SamplingBatch, argmax, filtered_logits, inverse_cdf, uniforms

PLACEHOLDER = -1

__all__ = ["PLACEHOLDER", "rejection_sample", "accepted_counts", "parse_output"]


def rejection_sample(
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sb: SamplingBatch,
) -> torch.Tensor:
    """Verify draft chains against the target; see the module docstring for the exact semantics.

    draft_token_ids: per sequence, its ``k_b`` draft ids (lists may differ in length, may be empty).
    draft_probs: None (deterministic drafts) or ``[B, >= max_k, V]`` full-vocab probabilities of the
        distributions the drafts were sampled from; rows at positions ``>= k_b`` are ignored.
    target_logits: ``[B, max_k + 1, V]``; position ``k_b`` of row ``b`` is its bonus position and
        positions past it are ignored.
    sb: the batch's sampling parameters (``B`` rows, one generator per row).

    Returns int64 ``[B, max_k + 1]`` padded with ``PLACEHOLDER``.
    """
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, max_k + 1, V], got shape {tuple(target_logits.shape)}")
    B, M1, V = target_logits.shape
    M = M1 - 1
    device = target_logits.device
    if len(draft_token_ids) != B:
        raise ValueError(f"{len(draft_token_ids)} draft lists for {B} rows of target logits")
    if len(sb.params) != B:
        raise ValueError(f"sampling batch has {len(sb.params)} rows, target logits {B}")
    ks = [len(d) for d in draft_token_ids]
    if B and max(ks) > M:
        raise ValueError(f"a row has {max(ks)} drafts but target_logits only has {M1} positions")
    out = torch.full((B, M1), PLACEHOLDER, dtype=torch.long, device=device)
    if B == 0:
        return out

    # drafts padded to [B, M]; invalid ids (pad, negative, >= V) never index anything
    padded = [list(d) + [PLACEHOLDER] * (M - len(d)) for d in draft_token_ids]
    drafts = torch.tensor(padded, dtype=torch.long, device=device).reshape(B, M)
    k = torch.tensor(ks, dtype=torch.long, device=device)
    cols = torch.arange(M1, device=device)
    in_chain = cols[:M].unsqueeze(0) < k.unsqueeze(1)  # [B, M]
    valid = (drafts >= 0) & (drafts < V)
    safe = torch.where(valid, drafts, torch.zeros_like(drafts))

    greedy = sb.greedy.to(device)
    if sb.all_greedy or bool(greedy.all()):
        return _greedy_rows(target_logits, drafts, in_chain, cols, out)

    if bool(greedy.any()):
        gidx = greedy.nonzero().squeeze(1)
        out[gidx] = _greedy_rows(target_logits[gidx], drafts[gidx], in_chain[gidx], cols, out[gidx])
    ridx = (~greedy).nonzero().squeeze(1)
    rlist = ridx.tolist()
    R = len(rlist)

    # p over every position of the random rows, exactly as plain sampling filters it
    counts = [0 if g else M1 for g in greedy.tolist()]
    sbr = sb.repeat(counts)
    logits_r = target_logits[ridx].float().reshape(R * M1, V)
    p = filtered_logits(logits_r, sbr).softmax(-1).reshape(R, M1, V)

    d_r, valid_r, safe_r, chain_r, k_r = drafts[ridx], valid[ridx], safe[ridx], in_chain[ridx], k[ridx]
    u, v = _row_randomness([sb.generators[b] for b in rlist], [ks[b] for b in rlist], M, device)
    rows = torch.arange(R, device=device)

    if M > 0:
        px = p[:, :M].gather(-1, safe_r.unsqueeze(-1)).squeeze(-1)
        px = torch.where(valid_r, px, torch.zeros_like(px))
        if draft_probs is not None:
            shape = tuple(draft_probs.shape)
            if len(shape) != 3 or shape[0] != B or shape[1] < M or shape[2] != V:
                raise ValueError(
                    f"draft_probs must be [B={B}, >= {M}, V={V}], got shape {tuple(draft_probs.shape)}"
                )
            q = draft_probs[ridx.to(draft_probs.device), :M].to(device=device, dtype=torch.float32)
            qx = q.gather(-1, safe_r.unsqueeze(-1)).squeeze(-1)
            pos_q = qx > 0
            ratio = px / torch.where(pos_q, qx, torch.ones_like(qx))
            accept = valid_r & pos_q & (u < ratio)
        else:
            accept = valid_r & (u < px)
        accept &= chain_r
        n_acc = accept.long().cumprod(1).sum(1)  # [R]
    else:
        n_acc = torch.zeros(R, dtype=torch.long, device=device)

    rejected = n_acc < k_r
    p_at = p[rows, n_acc]  # [R, V]: the rejection position or the bonus position
    dist = p_at
    if M > 0 and bool(rejected.any()):
        at = n_acc.clamp(max=M - 1)
        if draft_probs is not None:
            rec = (p_at - q[rows, at]).clamp_min(0.0)
        else:
            x = safe_r[rows, at]
            keep = torch.ones_like(p_at)
            keep[rows, x] = torch.where(valid_r[rows, at], 0.0, 1.0)
            rec = p_at * keep
        empty = ~(rec.sum(-1) > 0)  # also catches NaN
        rec = torch.where(empty.unsqueeze(-1), p_at, rec)
        dist = torch.where(rejected.unsqueeze(-1), rec, p_at)
    token = inverse_cdf(dist, v)

    out_r = torch.where(cols[:M].unsqueeze(0) < n_acc.unsqueeze(1), d_r, torch.full_like(d_r, PLACEHOLDER))
    out_r = torch.cat([out_r, torch.full((R, 1), PLACEHOLDER, dtype=torch.long, device=device)], 1)
    out_r.scatter_(1, n_acc.unsqueeze(1), token.unsqueeze(1))
    out[ridx] = out_r
    return out


def _greedy_rows(target_logits, drafts, in_chain, cols, out):
    """Greedy verification: no softmax, just the argmax of the raw logits."""
    M = drafts.shape[1]
    am = argmax(target_logits)  # [B, M + 1]
    if M > 0:
        match = (drafts == am[:, :M]) & in_chain
        n_acc = match.long().cumprod(1).sum(1)
    else:
        n_acc = torch.zeros(am.shape[0], dtype=torch.long, device=am.device)
    return torch.where(cols.unsqueeze(0) <= n_acc.unsqueeze(1), am, out)


def _row_randomness(gens: list[torch.Generator], ks: list[int], M: int, device):
    """Per row: ``ks[r]`` uniforms (padded to ``[R, M]`` with 1.0) then one more (``[R]``), float64.

    Rows that share one generator object draw from it together (all their acceptance uniforms, then
    one each for their draws), so a pool of generators costs two calls per generator, not per row. A
    generator used by a single row draws exactly ``k + 1`` uniforms. Draws happen on the generator's
    own device and are copied to ``device``."""
    R = len(gens)
    u = torch.ones(R, M, device=device, dtype=torch.float64)
    v = torch.empty(R, device=device, dtype=torch.float64)
    groups: dict[int, list[int]] = {}
    for r, g in enumerate(gens):
        groups.setdefault(id(g), []).append(r)
    for members in groups.values():
        g = gens[members[0]]
        if len(members) == 1:
            r = members[0]
            draw = uniforms(ks[r] + 1, g, device)
            u[r, : ks[r]] = draw[: ks[r]]
            v[r] = draw[ks[r]]
            continue
        rows = [r for r in members for _ in range(ks[r])]
        if rows:
            pos = [j for r in members for j in range(ks[r])]
            u[torch.tensor(rows, device=device), torch.tensor(pos, device=device)] = uniforms(len(rows), g, device)
        v[torch.tensor(members, device=device)] = uniforms(len(members), g, device)
    return u, v


def accepted_counts(output: torch.Tensor) -> list[int]:
    """Number of accepted draft tokens per row of a :func:`rejection_sample` output (emitted - 1)."""
    return ((output != PLACEHOLDER).sum(1) - 1).clamp_min(0).tolist()


def parse_output(output: torch.Tensor, vocab_size: int | None = None) -> list[list[int]]:
    """The emitted tokens per row, placeholders (and ids >= vocab_size, if given) dropped."""
    res = []
    for row in output.tolist():
        res.append([t for t in row if t != PLACEHOLDER and t >= 0 and (vocab_size is None or t < vocab_size)])
    return res
