"""Draft-tree buffers and tree verification (greedy and lossless sampling). CPU only, fixed seeds."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from specserve.config import SamplingParams
from specserve.sample.sampler import SamplingBatch
from specserve.sample.tree import TreeBuffers, tree_tokens_from_candidates, verify_tree_greedy, verify_tree_sample




def sb_row(seed: int = 0, **kw) -> SamplingBatch:
    return SamplingBatch.build([SamplingParams(**kw)], [torch.Generator().manual_seed(seed)])


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS6 = [-1, 0, 0, 1, 1, 2]


def test_buffers_hand_built():
    tb = TreeBuffers.from_parents(PARENTS6)
    T, F = True, False
    assert tb.attn_mask.dtype == torch.bool
    assert tb.attn_mask.tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, F, T, F, F, F],
        [T, T, F, T, F, F],
        [T, T, F, F, T, F],
        [T, F, T, F, F, T],
    ]
    assert tb.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tb.position_ids(7).tolist() == [7, 8, 8, 9, 9, 9]
    assert tb.retrieve_indices.dtype == torch.long
    assert tb.retrieve_indices.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tb.children == [[1, 2], [3, 4], [5], [], [], []]
    assert tb.path_to(4) == [0, 1, 4]


def test_buffers_uneven_depth_and_root_only():
    # 0 -> 1 -> 3 -> 4 ; 0 -> 2
    tb = TreeBuffers.from_parents([-1, 0, 0, 1, 3])
    assert tb.depth.tolist() == [0, 1, 1, 2, 3]
    assert tb.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]
    assert tb.attn_mask[4].tolist() == [True, True, False, True, True]
    root = TreeBuffers.from_parents([-1])
    assert root.retrieve_indices.tolist() == [[0]]
    assert root.attn_mask.tolist() == [[True]]


@pytest.mark.parametrize("bad", [[], [0], [-1, 1], [-1, 0, 3], [-1, -1]])
def test_buffers_reject_bad_parents(bad):
    with pytest.raises(ValueError):
        TreeBuffers.from_parents(bad)


def test_mask_matches_ancestor_closure_on_random_trees():
    rng = random.Random(0)
    for _ in range(20):
        N = rng.randint(1, 30)
        parents = [-1] + [rng.randrange(i) for i in range(1, N)]
        tb = TreeBuffers.from_parents(parents)
        for i in range(N):
            anc = {i}
            j = i
            while parents[j] >= 0:
                j = parents[j]
                anc.add(j)
            assert set(tb.attn_mask[i].nonzero().flatten().tolist()) == anc
            assert int(tb.depth[i]) == len(anc) - 1
        leaves = [i for i in range(N) if i not in parents[1:]]
        assert tb.retrieve_indices.shape == (len(leaves), int(tb.depth.max()) + 1)
        for row, leaf in zip(tb.retrieve_indices.tolist(), leaves):
            assert [n for n in row if n >= 0] == tb.path_to(leaf)


def test_from_rank_paths():
    paths = [[1, 0], [0, 0, 0], [0], [0, 1], [1], [0, 0]]  # deliberately unsorted
    tb = TreeBuffers.from_rank_paths(paths, topk=10)
    assert tb.rank_paths == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert tb.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert tb.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tb.tree_indices.tolist() == [0, 1, 2, 11, 12, 11, 21]
    # one row per leaf, leaves in increasing node index (4: [0,1], 5: [1,0], 6: [0,0,0])
    assert tb.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    # tokens = candidates[tree_indices], candidates = [root] + concat_k topk(head_k)
    head_topk = torch.arange(100, 130).view(3, 10)  # head k rank r -> 100 + 10k + r
    toks = tree_tokens_from_candidates(7, head_topk, tb)
    assert toks.tolist() == [7, 100, 101, 110, 111, 110, 120]
    # the node for a path holds head (len-1)'s token of rank path[-1]; its mask row covers its prefixes
    for i, p in enumerate(tb.rank_paths, start=1):
        assert int(toks[i]) == 100 + 10 * (len(p) - 1) + p[-1]
        prefixes = {tuple(p[:j]) for j in range(1, len(p) + 1)}
        seen = {tuple(tb.rank_paths[j - 1]) for j in tb.attn_mask[i].nonzero().flatten().tolist() if j > 0}
        assert seen == prefixes and bool(tb.attn_mask[i, 0])


def test_from_rank_paths_topk_and_errors():
    tb = TreeBuffers.from_rank_paths([[0], [2], [2, 3]], topk=4)
    assert tb.tree_indices.tolist() == [0, 1, 3, 8]
    with pytest.raises(ValueError):
        TreeBuffers.from_rank_paths([[0, 1]])  # missing parent [0]
    with pytest.raises(ValueError):
        TreeBuffers.from_rank_paths([[0], [10]], topk=10)
    with pytest.raises(ValueError):
        TreeBuffers.from_rank_paths([[0], [0]])


def _onehot(argmax: list[int], V: int) -> torch.Tensor:
    logits = torch.full((len(argmax), V), -10.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


def test_verify_greedy_picks_longest_path():
    tb = TreeBuffers.from_parents(PARENTS6)
    toks = torch.tensor([9, 5, 7, 3, 8, 2])
    V = 12
    # root argmax 7 -> node 2; node 2 argmax 2 -> node 5; node 5 argmax 4 -> emitted
    # (node 1 argmax 3 would match node 3, but node 1 itself is not accepted)
    assert verify_tree_greedy(toks, _onehot([7, 3, 2, 0, 0, 4], V), tb) == ([0, 2, 5], 4)
    # root argmax 5 -> node 1; node 1 argmax 8 -> node 4; emits node 4's argmax
    assert verify_tree_greedy(toks, _onehot([5, 8, 2, 0, 11, 4], V), tb) == ([0, 1, 4], 11)
    # depth-1 only
    assert verify_tree_greedy(toks, _onehot([5, 6, 2, 0, 11, 4], V), tb) == ([0, 1], 6)
    # nothing matches: the root's argmax
    assert verify_tree_greedy(toks, _onehot([1, 3, 2, 0, 0, 4], V), tb) == ([0], 1)
    # a greedy sampling row takes the same path and draws nothing
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    sb = SamplingBatch.build([SamplingParams(temperature=0.0)], [g])
    assert verify_tree_sample(toks, _onehot([7, 3, 2, 0, 0, 4], V), tb, sb) == ([0, 2, 5], 4)
    assert torch.equal(g.get_state(), state)


def test_verify_greedy_matches_medusa_cumprod_on_random_trees():
    """Cross-check with Medusa's formulation: per leaf path, cumprod of (token == argmax at parent)."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    V = 3  # tiny vocab: many matches
    for _ in range(200):
        N = rng.randint(1, 12)
        tb = TreeBuffers.from_parents([-1] + [rng.randrange(i) for i in range(1, N)])
        toks = torch.randint(0, V, (N,), generator=g)
        logits = torch.randn(N, V, generator=g)
        accepted, nxt = verify_tree_greedy(toks, logits, tb)
        am = logits.argmax(-1)
        ri = tb.retrieve_indices
        ext_tok = torch.cat([toks, torch.tensor([-1])])
        ext_am = torch.cat([am, torch.tensor([-2])])
        match = ext_tok[ri[:, 1:]] == ext_am[ri[:, :-1]]
        acc = match.long().cumprod(1).sum(1)
        assert len(accepted) - 1 == int(acc.max())
        best_len = len(accepted) - 1
        assert accepted[0] == 0 and accepted == tb.path_to(accepted[-1])
        assert all(int(toks[accepted[j + 1]]) == int(am[accepted[j]]) for j in range(best_len))
        assert nxt == int(am[accepted[-1]])


# ------------------------------------------------------------------------------ lossless walk

# tree of depth 2 over V = 4: the root has children A and B; A has children C and D. The tokens are
# chosen from the true model (its two likeliest tokens) so that every depth is reached often.
V4 = 4
TREE_PARENTS = [-1, 0, 0, 1, 1]


def _true_model(seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """A 'true' next-token distribution for every prefix of length 0..2 (bounded away from 0)."""
    g = torch.Generator().manual_seed(seed)
    model = {}
    for n in range(3):
        for prefix in itertools.product(range(V4), repeat=n):
            d = torch.rand(V4, generator=g) + 0.15
            model[prefix] = (d / d.sum()).double()
    return model


def _tree_tokens(model) -> list[int]:
    a, b = model[()].topk(2).indices.tolist()
    c, d = model[(a,)].topk(2).indices.tolist()
    return [0, a, b, c, d]  # node 0's token is the last verified one (not part of the prefixes here)


def _chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.0902: alpha = 1e-3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = expected_probs * n
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("temperature,top_k,n", [(1.0, -1, 20_000), (0.7, 3, 12_000)])
def test_tree_walk_is_lossless(temperature, top_k, n):
    """The first three generated tokens (the tree step, then plain steps if the walk stopped early)
    follow the exact chain of target conditionals p(t1) p(t2 | t1) p(t3 | t1, t2): chi-square test at
    a fixed seed (alpha = 1e-3)."""
    tb = TreeBuffers.from_parents(TREE_PARENTS)
    model = _true_model(5)
    tokens = _tree_tokens(model)
    toks = torch.tensor(tokens)
    prefix_of = [tuple(tokens[n] for n in tb.path_to(i)[1:]) for i in range(len(tokens))]
    tree_logits = torch.stack([model[pre].log().float() for pre in prefix_of])

    def plain_p(prefix):
        """What plain sampling draws from after prefix, computed independently of sampler.py."""
        logp = model[prefix].log() / temperature
        if top_k > 0:
            kth = logp.topk(top_k).values[-1]
            logp = logp.masked_fill(logp < kth, float("-inf"))
        return logp.softmax(-1)

    expected = torch.zeros(V4, V4, V4, dtype=torch.float64)
    for a, b, c in itertools.product(range(V4), repeat=3):
        expected[a, b, c] = plain_p(())[a] * plain_p((a,))[b] * plain_p((a, b))[c]

    sb = sb_row(123, temperature=temperature, top_k=top_k)
    outs, lengths = [], [0, 0, 0]
    for _ in range(n):
        accepted, emitted = verify_tree_sample(toks, tree_logits, tb, sb)
        lengths[len(accepted) - 1] += 1
        outs.append([tokens[i] for i in accepted[1:]] + [emitted])
    assert min(lengths) > n // 20, lengths  # the walk exercised every depth
    # plain decoding steps after the tree step (independent generator, exact target conditionals)
    g = torch.Generator().manual_seed(321)
    for depth in (1, 2):
        need = [o for o in outs if len(o) == depth]
        by_prefix: dict[tuple, list] = {}
        for o in need:
            by_prefix.setdefault(tuple(o), []).append(o)
        for prefix, rows in by_prefix.items():
            draws = torch.multinomial(plain_p(prefix), len(rows), replacement=True, generator=g).tolist()
            for o, t in zip(rows, draws):
                o.append(t)
    counts = torch.zeros(V4 ** 3, dtype=torch.float64)
    for o in outs:
        counts[o[0] * 16 + o[1] * 4 + o[2]] += 1
    keep = expected.flatten() > 0
    assert counts[~keep].sum() == 0  # top-k: nothing outside the allowed sets
    df = int(keep.sum()) - 1
    stat = _chi2(counts[keep], expected.flatten()[keep])
    assert stat < _chi2_critical(df), (stat, df)
    # power check: a chain that ignores the depth-1 conditional is clearly rejected by this test
    wrong = torch.zeros_like(expected)
    for a, b, c in itertools.product(range(V4), repeat=3):
        wrong[a, b, c] = plain_p(())[a] * plain_p(())[b] * plain_p((a, b))[c]
    assert _chi2(counts[keep], wrong.flatten()[keep]) > 5 * _chi2_critical(df)


def test_tree_walk_follows_certain_path_and_is_seeded():
    tb = TreeBuffers.from_parents(PARENTS6)
    toks = torch.tensor([9, 5, 7, 3, 8, 2])
    V = 10
    logits = torch.full((6, V), float("-inf"))
    logits[0, 5] = 0.0  # root: certainly 5 -> node 1
    logits[1, 3] = 0.0  # node 1: certainly 3 -> node 3
    logits[3, :] = 0.0  # node 3 (leaf): uniform
    accepted, emitted = verify_tree_sample(toks, logits, tb, sb_row(0))
    assert accepted == [0, 1, 3] and 0 <= emitted < V
    # same seed, same result; different seeds vary
    rand_logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    runs = [verify_tree_sample(toks, rand_logits, tb, sb_row(42)) for _ in range(5)]
    assert all(r == runs[0] for r in runs)
    many = {verify_tree_sample(toks, rand_logits, tb, sb_row(s))[1] for s in range(40)}
    assert len(many) > 3
    # an explicit generator overrides the row's
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert (verify_tree_sample(toks, rand_logits, tb, sb_row(1), g1)
            == verify_tree_sample(toks, rand_logits, tb, sb_row(2), g2))


def test_tree_walk_respects_top_p():
    tb = TreeBuffers.from_parents(PARENTS6)
    toks = torch.tensor([9, 5, 7, 3, 8, 2])
    V = 10
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2] + [0.0] * 7)).expand(6, V).clone()  # keeps 0, 1
    logits[0] = torch.log(torch.tensor([0.0] * 5 + [0.7, 0.0, 0.25, 0.0, 0.05]))  # root: keeps 5, 7
    seen_root = set()
    for s in range(200):
        accepted, emitted = verify_tree_sample(toks, logits, tb, sb_row(s, top_p=0.75))
        path_tokens = [int(toks[i]) for i in accepted[1:]] + [emitted]
        seen_root.add(path_tokens[0])
        assert path_tokens[0] in (5, 7)
        assert all(t in (0, 1) for t in path_tokens[1:])
    assert seen_root == {5, 7}


def test_tree_cache_builds_once_per_key_and_keeps_the_most_recent():
    from specserve.sample.tree import TreeBuffers, TreeCache

    built = []

    def build(parents):
        built.append(parents)
        return TreeBuffers.from_parents([-1, *parents])

    cache = TreeCache(build, size=2)
    a = cache.get((0, 0))
    assert cache.get((0, 0)) is a and built == [(0, 0)]
    assert a.parents == [-1, 0, 0] and a.max_depth == 1
    cache.get((0, 1))
    cache.get((0, 0))  # (0, 0) is now the most recent: (0, 1) goes first
    cache.get((0, 1, 2))
    assert len(cache) == 2
    cache.get((0, 0))
    assert built == [(0, 0), (0, 1), (0, 1, 2)]
    cache.get((0, 1))
    assert built[-1] == (0, 1)
