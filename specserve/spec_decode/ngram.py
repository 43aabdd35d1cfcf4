"""N-gram drafter (prompt lookup): match the sequence's last n tokens earlier in the sequence (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed the most
recent match."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.proposer import Proposal, Proposer, ProposeInputs, TreeDraft

PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN = 4, 1  # the n-gram lengths matched by default (longest first)
# the engine's n-gram branches as the demo and the bench's "-pool" rows use them (speculative_config keys):
# 3 continuations of up to 12 tokens, from the sequence itself and from earlier requests
POOLED_BRANCHES = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}


def ngram_propose(ids: torch.Tensor, k: int, n_max: int, n_min: int) -> list[int]:
    """ids: 1-D long tensor of the whole sequence. Returns up to k tokens that followed the most recent
    earlier occurrence of its last n tokens, for the largest n in [n_min, n_max] that has one."""
    found = ngram_candidates(ids, k, 1, None, n_max, n_min)
    return found[0][0] if found else []


class NgramPool:
    """The tokens of earlier requests (prompt and output of each finished one), indexed by their
    n-grams, so that a sequence's n-gram branch can also continue a phrase that an earlier answer
    used (as vLLM's suffix decoding does with a tree of earlier responses): a chat model answers
    different questions with the same phrases. Each n-gram keeps its ``per_key`` most recent
    occurrences; the oldest sequences are dropped past ``max_tokens`` tokens in all."""

    def __init__(self, n_max: int = PROMPT_LOOKUP_MAX, n_min: int = PROMPT_LOOKUP_MIN, max_tokens: int = 1 << 20,
                 per_key: int = 4):
        self.n_max, self.n_min, self.max_tokens, self.per_key = n_max, n_min, int(max_tokens), int(per_key)
        self._seqs: dict[int, list[int]] = {}  # sequence number -> tokens, oldest first
        self._next = 0
        self._total = 0
        self._index: dict[tuple, list[tuple[int, int]]] = {}  # n-gram -> [(sequence, continuation start)]

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, ids: list[int]) -> None:
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            return
        no, self._next = self._next, self._next + 1
        self._seqs[no] = ids
        self._total += len(ids)
        for key, start in self._ngrams(ids):
            hits = self._index.setdefault(key, [])
            hits.append((no, start))
            if len(hits) > self.per_key:
                del hits[0]
        while self._total > self.max_tokens and len(self._seqs) > 1:
            old = next(iter(self._seqs))
            gone = self._seqs.pop(old)
            self._total -= len(gone)
            for key, _ in self._ngrams(gone):  # its index entries go too
                hits = [h for h in self._index.get(key, ()) if h[0] != old]
                if hits:
                    self._index[key] = hits
                else:
                    self._index.pop(key, None)

    def _ngrams(self, ids: list[int]):
        """Every n-gram of ``ids`` that something follows, with where that continuation starts."""
        for n in range(self.n_min, self.n_max + 1):
            for j in range(len(ids) - n):
                yield tuple(ids[j : j + n]), j + n

    def continuations(self, suffix: list[int], k: int) -> list[list[int]]:
        """Up to k tokens that followed ``suffix`` in earlier sequences, most recent first."""
        out = []
        for no, start in reversed(self._index.get(tuple(suffix), ())):
            ids = self._seqs.get(no)
            if ids is not None:
                out.append(ids[start : start + k])
        return out


def ngram_candidates(ids: torch.Tensor, k: int, limit: int, pool: NgramPool | None = None,
                     n_max: int = PROMPT_LOOKUP_MAX, n_min: int = PROMPT_LOOKUP_MIN) -> list[tuple[list[int], int]]:
    """Up to ``limit`` distinct continuations (each up to k tokens) of the sequence ``ids`` (1-D long
    tensor), as (tokens, n): for n from ``n_max`` down, the tokens that followed the sequence's last n
    tokens earlier in itself (most recent first), then in ``pool``'s earlier sequences. A candidate
    that is a prefix of an earlier one adds nothing and is skipped."""
    L = ids.numel()
    out: list[tuple[list[int], int]] = []
    if k <= 0 or limit <= 0:
        return out

    def offer(tokens: list[int], n: int) -> bool:
        if tokens and not any(c[: len(tokens)] == tokens for c, _ in out):
            out.append((tokens, n))
        return len(out) >= limit

    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n :]
        hits = (ids[: L - 1].unfold(0, n, 1) == suffix).all(1).nonzero().flatten().tolist()
        for h in reversed(hits):
            if offer(ids[h + n : h + n + k].tolist(), n):
                return out
        if pool is not None:
            for tokens in pool.continuations(suffix.tolist(), k):
                if offer(tokens, n):
                    return out
    return out


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, num_speculative_tokens: int = 5, prompt_lookup_max: int = PROMPT_LOOKUP_MAX,
                 prompt_lookup_min: int = PROMPT_LOOKUP_MIN):
        if not (1 <= prompt_lookup_min <= prompt_lookup_max):
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.n_max, self.n_min = prompt_lookup_max, prompt_lookup_min

    def propose(self, inputs: ProposeInputs) -> Proposal:
        chains = []
        for seq, k in zip(inputs.seqs, inputs.max_drafts):
            ids = torch.tensor(seq.all_ids, dtype=torch.long)
            chains.append(ngram_propose(ids, min(k, self.num_speculative_tokens), self.n_max, self.n_min))
        return Proposal(chains)


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


@dataclass
class BranchDraft:
    """The n-gram continuation offered as a branch of a drafter's tree: its ``tokens`` and ``scores``,
    ``scores[d]`` the estimated probability that ``tokens[: d + 1]`` are all accepted (non-increasing)."""

    tokens: list[int]
    scores: list[float]


class BranchAcceptance:
    """Online estimate of how often the n-gram branches' tokens are accepted, per key (the engine's:
    the sampling setting, ``cost_model.sampling_key``, the length n of the matched n-gram, as a
    4-gram match predicts better than a 1-gram one, and the candidate's rank), so that a cost model
    can weigh each branch token against what verifying it costs, as it weighs a drafter's own nodes.

    At depth d it keeps exponentially decayed counts of the steps where the sequence's next d - 1
    tokens turned out to be the branch's (the branch's token d was "tried") and of those where the
    d-th was too; the conditional rate is ``(hits + prior * p0) / (tries + prior)`` (a depth without
    evidence takes the rate of the depth above it as ``p0``) and a token's score is the product of the
    rates down to it. The tokens a step emitted (accepted drafts + the target's own token) say this for
    every branch token up to their length, whether the step verified the branch or not: the estimate
    needs no exploration. Lossless: it reads earlier steps' emitted tokens only."""

    def __init__(self, max_depth: int, decay: float = 0.99, prior: float = 2.0, p0: float = 0.5):
        if not 0.0 < decay <= 1.0 or prior <= 0 or not 0.0 < p0 < 1.0:
            raise ValueError(f"need decay in (0, 1], prior > 0 and p0 in (0, 1), got {decay}, {prior}, {p0}")
        self.max_depth, self.decay, self.prior, self.p0 = int(max_depth), float(decay), float(prior), float(p0)
        self._stats: dict[tuple, list[list[float]]] = {}  # key -> [tries[d], hits[d]]

    def rates(self, key: tuple) -> list[float]:
        """The conditional acceptance rates at depths 1..max_depth."""
        st = self._stats.get(key)
        out: list[float] = []
        for d in range(self.max_depth):
            tries, hits = (st[0][d], st[1][d]) if st else (0.0, 0.0)
            above = out[-1] if out else self.p0
            out.append((hits + self.prior * above) / (tries + self.prior))
        return out

    def draft(self, key: tuple, tokens: list[int]) -> BranchDraft:
        scores, run = [], 1.0
        for r in self.rates(key)[: len(tokens)]:
            run *= r
            scores.append(run)
        return BranchDraft(list(tokens), scores)

    def observe(self, key: tuple, branch: list[int], emitted: list[int]) -> None:
        """A step that offered ``branch`` emitted ``emitted``."""
        if not branch or not emitted:
            return
        st = self._stats.setdefault(key, [[0.0] * self.max_depth, [0.0] * self.max_depth])
        for row in st:
            row[:] = [x * self.decay for x in row]
        for d, (b, e) in enumerate(zip(branch[: self.max_depth], emitted)):
            st[0][d] += 1.0
            if b != e:
                break
            st[1][d] += 1.0


def merge_branches(paths: list[tuple], scores: list[float], branches: list[BranchDraft]) -> list[tuple]:
    """A drafter's candidate nodes together with n-gram branches, for a cost model to choose from.
    ``paths[i]``: candidate i's tokens from the root (candidates form a tree: each one's parent is a
    candidate too), ``scores[i]`` its (calibrated) probability of acceptance, < 0 for one that must not
    be verified. Returns ``(score, depth, kind, key)`` items by decreasing score: kind 0 a candidate
    (key: its index), kind 1 a branch node that no candidate carries (key: its tokens from the root).
    A node that several branches carry scores the highest of their scores, and a candidate that a
    branch carries the higher of its own and the branch's. Every prefix of the items is a subtree: a
    node never scores above its parent."""
    scores = list(scores)
    index = {p: i for i, p in enumerate(paths)}
    nodes: dict[tuple, float] = {}  # branch-only nodes
    for br in branches:
        for j, p in enumerate(br.scores):
            key = tuple(br.tokens[: j + 1])
            i = index.get(key)
            if i is not None and scores[i] >= 0.0:
                scores[i] = max(scores[i], p)
            else:
                nodes[key] = max(nodes.get(key, 0.0), p)
    items = [(p, len(paths[i]), 0, i) for i, p in enumerate(scores) if p >= 0.0]
    items += [(p, len(key), 1, key) for key, p in nodes.items()]
    items.sort(key=lambda t: (-t[0], t[1]))
    return items


def split_items(items: list[tuple] | None, n: int, order: list[int]) -> tuple[list[int], list[list[int]]]:
    """What a cost model chose to verify, its first n nodes -> (the chosen candidates' indices, sorted;
    the chosen branch nodes' token paths, parents first: ready for ``graft``). ``items``: the
    ``merge_branches`` items, or None without branches: then the first n of the candidates' ``order``."""
    if items is None:
        return sorted(order[:n]), []
    picked = items[:n]
    return sorted(k for _, _, kind, k in picked if kind == 0), [list(k) for _, _, kind, k in picked if kind == 1]
