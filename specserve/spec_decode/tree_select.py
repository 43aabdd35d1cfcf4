"""Choosing what a step verifies: a drafter's scored candidate nodes merged with n-gram branches
(``merge_branches``), the cost model's pick split back into candidates and branch nodes
(``split_items``), and branches grafted into a draft tree as a trie (``graft``)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.proposer import TreeDraft


@dataclass
class BranchDraft:
    """The n-gram continuation offered as a branch of a drafter's tree: its ``tokens`` and ``scores``,
    ``scores[d]`` the estimated probability that ``tokens[: d + 1]`` are all accepted (non-increasing)."""

    tokens: list[int]
    scores: list[float]


def add_branch(tokens: list[int], parents: list[int], branch: list[int]) -> tuple[list[int], list[int]]:
    """Insert the draft chain ``branch`` below the root of the tree (``tokens``, ``parents``: node 0 the
    root) as a trie does: follow the existing children that carry its tokens, then append the rest as
    new nodes (after every existing one, so ``parents[i] < i`` still holds). Returns new lists."""
    tokens, parents = list(tokens), list(parents)
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(parents)):
        children.setdefault((parents[i], tokens[i]), i)  # the first child with a token (verification's pick)
    node = 0
    for t in branch:
        nxt = children.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = children[(node, t)] = len(tokens) - 1
        node = nxt
    return tokens, parents


def graft(tree: TreeDraft | None, root: int, chain: list[int], branches: list[list[int]],
          cache) -> tuple[TreeDraft | None, int | None]:
    """A draft (``tree``, or else the chain ``chain`` below ``root``) with ``branches`` inserted
    (``add_branch``, in turn). Returns (the draft, how many of its nodes, root included, were there before: a
    prefix), or (``tree`` unchanged, None) when the branch adds no node. ``cache``: a
    ``specserve.sample.tree.TreeCache`` of buffers keyed by the parents tuple."""
    if tree is None:
        tokens, parents = [root] + list(chain), list(range(-1, len(chain)))
    else:
        tokens, parents = list(tree.tokens), list(tree.buffers.parents)
    n = len(tokens)
    for branch in branches:
        tokens, parents = add_branch(tokens, parents, branch)
    if len(tokens) == n:
        return tree, None
    return TreeDraft(tokens, cache.get(tuple(parents))), n


def merge_branches(child, depths: list[int], scores: list[float], branches: list[BranchDraft]) -> list[tuple]:
    """A drafter's candidate nodes together with n-gram branches, for a cost model to choose from. The
    candidates form a tree: ``child(node, token)`` is the candidate below candidate ``node`` (-1: the
    root) that carries ``token``, or None; ``depths[i]`` is candidate i's depth, ``scores[i]`` its
    (calibrated) probability of acceptance, < 0 for one that must not be verified. Returns ``(score,
    depth, kind, key)`` items by decreasing score: kind 0 a candidate (key: its index), kind 1 a branch
    node that no candidate carries (key: its tokens from the root). A node that several branches carry
    scores the highest of their scores, and a candidate that a branch carries the higher of its own and
    the branch's. Every prefix of the items is a subtree: a node never scores above its parent."""
    scores = list(scores)
    nodes: dict[tuple, float] = {}  # branch-only nodes
    for br in branches:
        node = -1
        for j, p in enumerate(br.scores):
            node = None if node is None else child(node, br.tokens[j])
            if node is not None and scores[node] >= 0.0:
                scores[node] = max(scores[node], p)
            else:
                key = tuple(br.tokens[: j + 1])
                nodes[key] = max(nodes.get(key, 0.0), p)
    items = [(p, depths[i], 0, i) for i, p in enumerate(scores) if p >= 0.0]
    items += [(p, len(key), 1, key) for key, p in nodes.items()]
    items.sort(key=lambda t: (-t[0], t[1]))
    return items


def no_candidates(node: int, token: int) -> None:
    """``merge_branches``' ``child`` where there is no candidate tree (branches alone)."""
    return None


def unsorted(ranked: list[float], order: list[int]) -> list[float]:
    """Scores back in node order from a ranking: ``ranked[j]`` is node ``order[j]``'s."""
    out = [0.0] * len(order)
    for s, i in zip(ranked, order):
        out[i] = s
    return out


def split_items(items: list[tuple] | None, n: int, order: list[int]) -> tuple[list[int], list[list[int]]]:
    """What a cost model chose to verify, its first n nodes -> (the chosen candidates' indices, sorted;
    the chosen branch nodes' token paths, parents first: ready for ``graft``). ``items``: the
    ``merge_branches`` items, or None without branches: then the first n of the candidates' ``order``."""
    if items is None:
        return sorted(order[:n]), []
    picked = items[:n]
    return sorted(k for _, _, kind, k in picked if kind == 0), [list(k) for _, _, kind, k in picked if kind == 1]
