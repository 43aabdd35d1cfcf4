"""Draft trees (Medusa-style): buffers for one tree-attention forward pass, and verification.

A tree of ``N`` nodes is given by parent indices: node 0 is the root (the last verified token, whose
logits score the first draft level) and every other node ``i`` has ``parents[i] < i``. The target
model runs once over all ``N`` tree tokens with

* ``attn_mask[i, j]`` True iff node ``j`` is an ancestor of ``i`` or ``i`` itself (every node also
  sees the whole cached prefix), and
* position ids ``prefix_len + depth`` (siblings share a position),

so the logits at node ``n`` are the target's next-token logits after ``prefix + path(root -> n)``.

Verification picks the accepted root->node path and one extra token to emit:

* :func:`verify_tree_greedy`: the longest path whose every token is the target argmax at its parent,
  then the argmax at the last accepted node (exactly what greedy decoding would produce).
* :func:`verify_tree_sample`: lossless sampling, one target draw per visited node (see its docstring).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from specserve.sample.sampler import SamplingBatch, argmax, filtered_logits, inverse_cdf, uniforms

__all__ = ["TreeBuffers", "TreeCache", "verify_tree_greedy", "verify_tree_sample", "tree_tokens_from_candidates"]


@dataclass
class TreeBuffers:
    """Precomputed tensors of one draft tree.

    parents: ``parents[0] == -1``; ``parents[i] < i`` for ``i >= 1``.
    attn_mask: bool ``[N, N]``, True = visible (ancestors and self).
    depth: long ``[N]``, root 0. Position ids are ``prefix_len + depth``.
    retrieve_indices: long ``[P, D + 1]``, one row per leaf (leaves in increasing node index), the
        node indices root->leaf, padded with -1. ``D`` is the tree's depth.
    children: ``children[i]`` = child node indices of ``i``, increasing.
    tree_indices: long ``[N]`` or None; for trees built from Medusa rank paths, the index of each
        node's token in the candidate vector ``[root] + concat_k topk(head_k)``.
    rank_paths: the sorted rank paths (node ``i >= 1`` is ``rank_paths[i - 1]``), or None.
    """

    parents: list[int]
    attn_mask: torch.Tensor
    depth: torch.Tensor
    retrieve_indices: torch.Tensor
    children: list[list[int]]
    tree_indices: torch.Tensor | None = None
    rank_paths: list[list[int]] | None = None
    topk: int | None = None
    _depth_list: list[int] = field(default_factory=list, repr=False)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self._depth_list)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """Position ids ``[N]`` of the tree tokens when ``prefix_len`` tokens precede the root (the root
        is at position ``prefix_len``, siblings share a position)."""
        return self.depth + prefix_len

    def path_to(self, node: int) -> list[int]:
        """Node indices root -> ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def to(self, device) -> "TreeBuffers":
        return TreeBuffers(
            parents=self.parents, attn_mask=self.attn_mask.to(device), depth=self.depth.to(device),
            retrieve_indices=self.retrieve_indices.to(device), children=self.children,
            tree_indices=None if self.tree_indices is None else self.tree_indices.to(device),
            rank_paths=self.rank_paths, topk=self.topk, _depth_list=self._depth_list,
        )

    @classmethod
    def from_parents(cls, parents: list[int]) -> "TreeBuffers":
        parents = [int(p) if p is not None else -1 for p in parents]
        N = len(parents)
        if N == 0:
            raise ValueError("a tree needs at least the root node")
        if parents[0] != -1:
            raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
        for i in range(1, N):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i} has parent {parents[i]}; parents must satisfy 0 <= parents[i] < i")
        depth = [0] * N
        children: list[list[int]] = [[] for _ in range(N)]
        mask = torch.zeros(N, N, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, N):
            p = parents[i]
            depth[i] = depth[p] + 1
            children[p].append(i)
            mask[i] = mask[p]
            mask[i, i] = True
        D = max(depth)
        leaves = [i for i in range(N) if not children[i]]
        retrieve = torch.full((len(leaves), D + 1), -1, dtype=torch.long)
        for r, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                retrieve[r, depth[node]] = node
                node = parents[node]
        return cls(
            parents=parents, attn_mask=mask, depth=torch.tensor(depth, dtype=torch.long),
            retrieve_indices=retrieve, children=children, _depth_list=depth,
        )

    @classmethod
    def from_rank_paths(cls, paths: list[list[int]] | list[tuple[int, ...]], topk: int = 10) -> "TreeBuffers":
        """Medusa "choices": ``[0]`` is head 0's rank-0 token, ``[0, 1]`` its child holding head 1's
        rank-1 token, ... Paths are sorted by ``(len, lex)`` (as Medusa does); node ``i`` (1-based) is
        the i-th sorted path. Every proper prefix of a path must itself be a path."""
        norm = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if len(norm) != len(paths):
            raise ValueError("duplicate rank paths")
        index = {(): 0}
        parents = [-1]
        tree_indices = [0]
        for i, p in enumerate(norm, start=1):
            if not p:
                raise ValueError("empty rank path (the root is implicit)")
            if any(not 0 <= r < topk for r in p):
                raise ValueError(f"rank path {list(p)} has a rank outside [0, {topk})")
            if p[:-1] not in index:
                raise ValueError(f"rank path {list(p)} has no parent path {list(p[:-1])}")
            index[p] = i
            parents.append(index[p[:-1]])
            tree_indices.append(p[-1] + topk * (len(p) - 1) + 1)
        tb = cls.from_parents(parents)
        tb.tree_indices = torch.tensor(tree_indices, dtype=torch.long)
        tb.rank_paths = [list(p) for p in norm]
        tb.topk = topk
        return tb


class TreeCache:
    """The ``TreeBuffers`` of the trees dynamic drafting builds (or what ``build`` makes with them), kept by
    a key (a shape recurs step after step); the ``size`` most recently used are kept."""

    def __init__(self, build: Callable[[Hashable], object], size: int = 4096):
        self.build, self.size = build, size
        self._trees: OrderedDict = OrderedDict()

    @classmethod
    def by_parents(cls, size: int = 4096) -> "TreeCache":
        """A cache keyed by the trees' parents tuples."""
        return cls(lambda parents: TreeBuffers.from_parents(list(parents)), size)

    def get(self, key: Hashable):
        buf = self._trees.get(key)
        if buf is None:
            buf = self._trees[key] = self.build(key)
            if len(self._trees) > self.size:
                self._trees.popitem(last=False)
        else:
            self._trees.move_to_end(key)
        return buf

    def __len__(self) -> int:
        return len(self._trees)


def tree_tokens_from_candidates(root_token: int | torch.Tensor, head_topk: torch.Tensor,
                                buffers: TreeBuffers) -> torch.Tensor:
    """Tree tokens ``[N]`` of a rank-path tree: ``candidates[tree_indices]`` with
    ``candidates = [root] + concat_k head_topk[k]`` (``head_topk``: ``[K, topk]`` token ids, rank order)."""
    if buffers.tree_indices is None:
        raise ValueError("tree was not built from rank paths")
    root = torch.as_tensor(root_token, dtype=torch.long, device=head_topk.device).reshape(1)
    cand = torch.cat([root, head_topk.reshape(-1).long()])
    return cand[buffers.tree_indices.to(cand.device)]


def _check(tree_tokens: torch.Tensor, target_logits: torch.Tensor, buffers: TreeBuffers) -> None:
    N = buffers.num_nodes
    if tree_tokens.shape[0] != N or target_logits.dim() != 2 or target_logits.shape[0] != N:
        raise ValueError(
            f"expected tree_tokens [{N}] and target_logits [{N}, V], got {tuple(tree_tokens.shape)} "
            f"and {tuple(target_logits.shape)}"
        )


def verify_tree_greedy(tree_tokens: torch.Tensor, target_logits: torch.Tensor,
                       buffers: TreeBuffers) -> tuple[list[int], int]:
    """Greedy tree verification.

    Returns ``(accepted, next_token)``: ``accepted`` the node indices root-first (always starts with
    0) of the longest path whose every non-root token equals the target argmax at its parent (ties
    between equally long paths go to the smaller node index), and ``next_token`` the target argmax
    at the last accepted node. The emitted tokens are ``tree_tokens[accepted[1:]] + [next_token]``.
    """
    _check(tree_tokens, target_logits, buffers)
    am = argmax(target_logits).tolist()
    toks = tree_tokens.tolist()
    parents, depth = buffers.parents, buffers._depth_list
    ok = [True] + [False] * (len(parents) - 1)
    best = 0
    for i in range(1, len(parents)):
        p = parents[i]
        if ok[p] and toks[i] == am[p]:
            ok[i] = True
            if depth[i] > depth[best]:
                best = i
    return buffers.path_to(best), int(am[best])


def verify_tree_sample(
    tree_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    buffers: TreeBuffers,
    sb_row: SamplingBatch,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless tree verification at temperature > 0 (deterministic, one-hot drafts).

    Walk from the root: at the current node ``n`` draw one ``y ~ p(. | n)``, where ``p`` is the
    distribution plain sampling would draw from after ``prefix + path(n)`` (``softmax`` of
    ``filtered_logits`` of node ``n``'s target logits); if a child of ``n`` carries token ``y`` move to
    it and repeat, otherwise emit ``y`` and stop. Returns ``(accepted, emitted)``: the visited node
    indices root-first, and the emitted token.

    Why it is lossless: every token produced in this step, the accepted child tokens and the emitted
    one, is exactly one fresh draw ``y ~ p(. | path so far)``, because the tree attention makes node
    ``n``'s logits the target's next-token logits after ``prefix + path(n)`` and we only move to a child
    when its token *is* the draw. So the step produces ``t_1 ~ p(. | prefix)``, ``t_2 ~ p(. | prefix,
    t_1)``, ... : the same chain of conditionals as plain ancestral sampling. The tree only decides
    how many draws happen in this step (stopping when a draw leaves the tree), and that decision is
    a function of the draws already made, so it does not bias them. This is recursive multi-draft
    rejection sampling with one-hot drafts: a sibling carrying ``y`` is accepted with probability 1
    given ``y``, and the residual after rejecting all children is ``p`` restricted to tokens that are
    not children, renormalised: the same as "draw ``y`` and stop if no child has it".

    Randomness: ``D + 1`` uniforms ``u_0 .. u_D`` (``D`` the tree's depth) from ``generator`` (default
    ``sb_row.generators[0]``), a fixed amount whatever the outcome; the draw at a node of depth ``d`` is
    the inverse-CDF draw of ``p(. | node)`` with ``u_d``. A walk visits each depth at most once, so its
    draws are independent, and only the visited nodes' distributions are computed. Greedy rows delegate
    to :func:`verify_tree_greedy` and draw nothing.
    """
    _check(tree_tokens, target_logits, buffers)
    if len(sb_row.params) != 1:
        raise ValueError(f"sb_row must hold exactly one row, got {len(sb_row.params)}")
    if bool(sb_row.greedy[0]):
        return verify_tree_greedy(tree_tokens, target_logits, buffers)
    g = generator if generator is not None else sb_row.generators[0]
    u = uniforms(buffers.max_depth + 1, g)
    toks = tree_tokens.tolist()
    node = 0
    accepted = [0]
    while True:
        d = buffers._depth_list[node]
        p = filtered_logits(target_logits[node : node + 1].float(), sb_row).softmax(-1)
        y = int(inverse_cdf(p, u[d : d + 1]))
        nxt = next((c for c in buffers.children[node] if toks[c] == y), None)  # first child on duplicates
        if nxt is None:
            return accepted, y
        node = nxt
        accepted.append(node)
