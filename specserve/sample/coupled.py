"""Coupled sampling: each output token's randomness is a function of the request's seed and the
token's position alone, so a seeded request's text is a function of (seed, target model) only.

The token at absolute position ``t`` (its index in prompt + output) is ``inverse_cdf(p_t, u(seed, t))``:
``p_t`` the distribution plain sampling draws from (temperature, top-k, top-p, min-p exactly as
:mod:`specserve.sample.sampler` applies them) and ``u(seed, t)`` a uniform in [0, 1) from a
counter-based hash of the pair (``position_uniform``), not from a stream whose state depends on how
many numbers were drawn before.

Speculative verification computes the target's token ``y_j`` at every verified position with that rule
and accepts draft ``d_j`` iff ``d_j == y_j``; at the first mismatch it emits ``y_j`` and stops (a tree:
walk from the root, descend into the child that carries ``y``). Every emitted token is then the
target's own token for its prefix and position: the output is plain decoding's with the same seed,
token for token, whatever the drafter, the draft shape, the cost model's choices, the batch or the
tensor-parallel size (given logits that are the same bits in all of them: the batch-invariant
forwards). Each token is an exact sample of ``p_t``, since ``u(seed, t)`` is independent of the
earlier tokens, which depend on other positions' uniforms only.

What it costs: a deterministic draft ``d`` is accepted with probability ``p(d)``, a tree node's
children ``C`` with ``p(C)``: the same as rejection sampling (``rejection_sampler``,
``tree.verify_tree_sample``) with one-hot drafts. Drafts sampled from a draft distribution ``q`` with
the drafter's own randomness are accepted with probability ``sum_i p_i q_i`` instead of rejection
sampling's ``sum_i min(p_i, q_i)``: see ``docs/sampling.md`` for the measured figures.
"""

from __future__ import annotations

import torch

from specserve.sample.sampler import SamplingBatch, argmax, draw
from specserve.sample.tree import TreeBuffers

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs look independent."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) (53 random bits) that depends on ``(seed, position)`` only."""
    key = _mix64((int(seed) & _MASK) ^ 0x9E3779B97F4A7C15)
    return (_mix64((key + (int(position) + 1) * 0x9E3779B97F4A7C15) & _MASK) >> 11) * 2.0**-53


def coupled_tokens(logits: torch.Tensor, sb_row: SamplingBatch, seed: int, positions: list[int]) -> list[int]:
    """The target's tokens at ``positions``: logits [n, V] of one request (``sb_row``: its one row) ->
    ``inverse_cdf(p, u(seed, position))`` for each of the n rows (argmax for a greedy request)."""
    if bool(sb_row.greedy[0]):
        return argmax(logits).tolist()
    n = logits.shape[0]
    u = torch.tensor([position_uniform(seed, t) for t in positions], dtype=torch.float64)
    return draw(logits, sb_row.repeat([n]) if n > 1 else sb_row, u.to(logits.device)).tolist()


def verify_chain_coupled(drafts: list[int], logits: torch.Tensor, sb_row: SamplingBatch, seed: int,
                         first_position: int) -> list[int]:
    """Drafts ``d_0 .. d_{k-1}`` and the target logits at their k + 1 positions (``first_position`` is
    the absolute position of the token that follows the verified prefix) -> the emitted tokens: the
    drafts up to the first one that differs from the target's token, then the target's token there
    (or the bonus token after all k)."""
    out: list[int] = []
    for j in range(len(drafts) + 1):  # a position's token is drawn only where every draft before it held
        out += coupled_tokens(logits[j : j + 1], sb_row, seed, [first_position + j])
        if j == len(drafts) or drafts[j] != out[-1]:
            break
    return out


def verify_tree_coupled(tree_tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers,
                        sb_row: SamplingBatch, seed: int, first_position: int) -> tuple[list[int], int]:
    """Tree verification with coupled sampling: node ``v``'s target token is drawn for position
    ``first_position + depth(v)`` (siblings share it); walk from the root into the child that carries
    it (the first such child where siblings repeat a token). Returns ``(accepted nodes root-first,
    emitted token)`` as ``tree.verify_tree_sample`` does; only the visited nodes' distributions are
    computed."""
    toks = tree_tokens.tolist()
    node, accepted = 0, [0]
    while True:
        (y,) = coupled_tokens(logits[node : node + 1], sb_row, seed, [first_position + buffers._depth_list[node]])
        nxt = next((c for c in buffers.children[node] if toks[c] == y), None)
        if nxt is None:
            return accepted, y
        node = nxt
        accepted.append(node)
