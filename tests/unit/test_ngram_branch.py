"""``ngram_branch``: the n-gram (prompt lookup) continuation of the sequence as one more branch of every
draft of another drafter; verification stays lossless whichever branch wins."""

import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.spec_decode.ngram.branches import BranchAcceptance, NgramBranchOptions, split_ngram_branch
from specserve.spec_decode.ngram.index import NgramPool, ngram_candidates
from specserve.spec_decode.tree_select import BranchDraft, add_branch, merge_branches, no_candidates, split_items

from test_dspark import write_random_drafter
from test_medusa import make_heads
from test_spec_engine import assert_same_distribution, sample_prefixes


def test_add_branch_shares_existing_nodes_and_appends_the_rest():
    tokens, parents = [1, 7, 8, 9], [-1, 0, 1, 0]  # root -> 7 -> 8, root -> 9
    assert add_branch(tokens, parents, [7, 8]) == (tokens, parents)  # already in the tree
    assert add_branch(tokens, parents, [7, 5, 6]) == ([1, 7, 8, 9, 5, 6], [-1, 0, 1, 0, 1, 4])
    assert add_branch(tokens, parents, [9, 9]) == ([1, 7, 8, 9, 9], [-1, 0, 1, 0, 3])
    assert add_branch(tokens, parents, [4]) == ([1, 7, 8, 9, 4], [-1, 0, 1, 0, 0])
    assert add_branch([1], [-1], [4, 4]) == ([1, 4, 4], [-1, 0, 1])  # below a bare root
    assert add_branch(tokens, parents, []) == (tokens, parents)
    assert tokens == [1, 7, 8, 9] and parents == [-1, 0, 1, 0]  # inputs untouched


def test_split_ngram_branch_takes_the_engine_options_out():
    spec = SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 5, "medusa_tree": "auto"})
    own, opts = split_ngram_branch(spec)
    assert opts == NgramBranchOptions(5, 1, False) and own.method == "medusa" and own.options == {"medusa_tree": "auto"}
    assert spec.options["ngram_branch"] == 5  # the caller's config is not changed
    full = {"method": "dspark", "ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
    own, opts = split_ngram_branch(SpeculativeConfig.from_dict(full))
    assert opts == NgramBranchOptions(12, 3, True) and own.options == {}
    assert split_ngram_branch(None) == (None, NgramBranchOptions())
    plain = SpeculativeConfig.from_dict({"method": "medusa"})
    assert split_ngram_branch(plain) == (plain, NgramBranchOptions())
    for bad in (True, -1, 33, "5", 2.0):
        with pytest.raises(ValueError, match="ngram_branch must be an int"):
            split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": bad}))
    for bad in (0, 9, True, "2"):
        with pytest.raises(ValueError, match="ngram_candidates must be an int"):
            split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 4,
                                                            "ngram_candidates": bad}))
    with pytest.raises(ValueError, match="ngram_pool must be true or false"):
        split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 4, "ngram_pool": 1}))
    with pytest.raises(ValueError, match="need ngram_branch"):
        split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_pool": True}))
    with pytest.raises(ValueError, match="already drafts"):
        split_ngram_branch(SpeculativeConfig.from_dict({"method": "ngram", "ngram_branch": 3}))


def test_ngram_candidates_own_matches_first_then_the_pool_longest_n_first():
    ids = torch.tensor([5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 2, 3])
    # the 2-gram (2, 3) occurs twice earlier: most recent first; then the 1-gram 3's other continuation
    assert ngram_candidates(ids, 2, 1) == [([7, 4], 2)]
    assert ngram_candidates(ids, 2, 2) == [([7, 4], 2), ([9, 1], 2)]
    assert ngram_candidates(ids, 2, 4) == [([7, 4], 2), ([9, 1], 2)]  # the 1-gram (3) repeats those
    assert ngram_candidates(ids, 1, 4) == [([7], 2), ([9], 2)]
    pool = NgramPool()
    pool.add([8, 4, 2, 3, 6, 6])  # (4, 2, 3): a 3-gram match in an earlier request beats the own 2-grams
    assert ngram_candidates(ids, 3, 3, pool) == [([6, 6], 3), ([7, 4, 2], 2), ([9, 1, 2], 2)]
    assert ngram_candidates(ids, 0, 3, pool) == [] and ngram_candidates(ids, 3, 0, pool) == []
    assert ngram_candidates(torch.tensor([1, 2, 3]), 4, 3) == []  # nothing repeats


def test_ngram_pool_keeps_the_most_recent_and_drops_the_oldest_sequences():
    pool = NgramPool(max_tokens=10, per_key=2)
    pool.add([1, 2, 3])
    pool.add([1, 2, 4])
    assert pool.continuations([1, 2], 2) == [[4], [3]] and pool.continuations([2], 1) == [[4], [3]]
    pool.add([1, 2, 5, 6])
    assert pool.continuations([1, 2], 5) == [[5, 6], [4]]  # two kept per n-gram
    pool.add([7, 7, 7, 7])  # 14 tokens in all > 10: the oldest sequences go
    assert len(pool) == 2 and pool.continuations([1, 2], 5) == [[5, 6]]
    kept = {no for hits in pool._index.values() for no, _ in hits}
    assert kept == {2, 3}  # the dropped sequences' index entries are gone too
    assert pool.continuations([9], 3) == []
    pool.add([1])  # nothing to index
    assert len(pool) == 2


def test_branch_acceptance_learns_per_key_from_what_steps_emitted():
    acc = BranchAcceptance(max_depth=4, decay=1.0, prior=2.0, p0=0.5)
    assert acc.rates("a") == [0.5] * 4
    for _ in range(8):  # key a: the first token always right, the second always wrong
        acc.observe("a", [1, 2, 3], [1, 9, 5])
    r = acc.rates("a")
    assert r[0] == pytest.approx((8 + 1) / (8 + 2)) and r[1] == pytest.approx(2 * r[0] / (8 + 2))
    assert r[2] == pytest.approx(r[1])  # no evidence at depth 3: the depth above's rate
    d = acc.draft("a", [1, 2, 3])
    assert d.tokens == [1, 2, 3] and d.scores == pytest.approx([r[0], r[0] * r[1], r[0] * r[1] * r[2]])
    assert acc.rates("b") == [0.5] * 4  # keys are apart
    acc.observe("b", [4, 4], [4])  # the emitted tokens end: depth 2 untried
    assert acc.rates("b")[:2] == pytest.approx([2 / 3, 2 / 3])
    decaying = BranchAcceptance(max_depth=1, decay=0.5, prior=1.0, p0=0.5)
    decaying.observe("k", [1], [2])
    decaying.observe("k", [1], [1])  # the older miss weighs half
    assert decaying.rates("k")[0] == pytest.approx((1 + 0.5) / (1.5 + 1))
    with pytest.raises(ValueError):
        BranchAcceptance(4, p0=1.0)


def _tree(paths):
    """``merge_branches``' ``child`` and depths for candidates given by their token paths."""
    index = {p: i for i, p in enumerate(paths)}
    return (lambda node, t: index.get((paths[node] if node >= 0 else ()) + (t,))), [len(p) for p in paths]


def test_merge_branches_orders_nodes_so_that_every_prefix_is_a_subtree():
    # candidates: root -> 7 (0.6) -> 8 (0.3); root -> 9 (0.2); 7 -> 8 -> 1 (-1: too deep)
    paths = [(7,), (7, 8), (9,), (7, 8, 1)]
    scores = [0.6, 0.3, 0.2, -1.0]
    branches = [BranchDraft([7, 8, 5], [0.5, 0.45, 0.4]), BranchDraft([4, 4], [0.25, 0.05]),
                BranchDraft([7, 8, 5, 6], [0.1, 0.1, 0.1, 0.01]), BranchDraft([7, 8, 1, 2], [0.1, 0.1, 0.03, 0.02])]
    items = merge_branches(*_tree(paths), scores, branches)
    assert [(round(p, 2), d, kind, k) for p, d, kind, k in items] == [
        (0.6, 1, 0, 0), (0.45, 2, 0, 1), (0.4, 3, 1, (7, 8, 5)), (0.25, 1, 1, (4,)), (0.2, 1, 0, 2),
        (0.05, 2, 1, (4, 4)), (0.03, 3, 1, (7, 8, 1)), (0.02, 4, 1, (7, 8, 1, 2)), (0.01, 4, 1, (7, 8, 5, 6))]
    for n in range(len(items) + 1):
        chosen, extra = split_items(items, n, [])
        have = {()} | {paths[i] for i in chosen} | {tuple(e) for e in extra}
        assert all(p[:-1] in have for p in have if p), n  # every chosen node's parent is chosen
    assert split_items(items, 4, []) == ([0, 1], [[7, 8, 5], [4]])
    assert split_items(None, 2, [2, 0, 1]) == ([0, 2], [])  # without branches: the candidates in order
    assert merge_branches(*_tree(paths), scores, []) == [(0.6, 1, 0, 0), (0.3, 2, 0, 1), (0.2, 1, 0, 2)]
    assert merge_branches(no_candidates, [], [], branches[1:2]) == [(0.25, 1, 1, (4,)), (0.05, 2, 1, (4, 4))]


REPETITIVE = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 8, 7, 9, 8, 7, 9], [20, 21, 22, 23, 24, 25]]


# the drafters whose cost model weighs the branch tokens with their own (``plans_branches``)
PLANNED = {"medusa-dynamic": {"medusa_tree": "auto", "medusa_verify": "auto"},
           "dspark-tree-auto": {"dspark_tree": "auto"}}
POOLED = {"ngram_branch": 6, "ngram_candidates": 3, "ngram_pool": True}


def _verify_all(llm):
    """A planned drafter on a cost curve where verifying costs the same for any node count: it takes
    every candidate and every branch node (on measured costs what it takes varies from run to run)."""
    if llm.engine.proposer.inner.plans_branches:
        llm.engine.proposer.inner.verify_costs = {1: 1.0, 4096: 1.0}
    return llm


# the plain kinds are chains without branches (the methods' defaults are trees with pooled branches)
CHAIN = {"medusa": {"medusa_tree": None, "medusa_verify": "full", "ngram_branch": 0},
         "dspark": {"dspark_tree": None, "ngram_branch": 0}}


def _drafter(kind, model_dir, tmp_path):
    if kind.startswith("medusa"):
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], shared=False, scale=1.0)
        spec = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3, **CHAIN["medusa"]}
        if kind == "medusa-dynamic":
            return {**spec, **PLANNED[kind], "medusa_topk": 3}
        return {**spec, "medusa_tree": 8, "medusa_topk": 3} if kind == "medusa-tree" else spec
    drafter = write_random_drafter(tmp_path / "d", model_dir, scale=0.6)
    tree = {"dspark-tree": {"dspark_tree": 8}, "dspark-tree-auto": PLANNED["dspark-tree-auto"]}.get(kind, {})
    return {"method": "dspark", "model": str(drafter), **CHAIN["dspark"], **tree}


@pytest.mark.parametrize("kind,branch", [("medusa", 5), ("medusa-tree", 5), ("dspark", 5), ("dspark-tree", 5),
                                         ("medusa-dynamic", 5), ("medusa-dynamic", POOLED),
                                         ("dspark-tree-auto", POOLED), ("dspark", POOLED)])
def test_greedy_identical_to_plain_and_the_branch_wins_steps(tiny_llama, tmp_path, kind, branch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(REPETITIVE, params, use_tqdm=False)]
    spec = _drafter(kind, tiny_llama, tmp_path)
    without = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec)
    branch = {"ngram_branch": branch} if isinstance(branch, int) else branch
    with_branch = _verify_all(LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, **branch}))
    assert with_branch.engine.proposer.inner.plans_branches == (kind in PLANNED)
    for llm in (without, with_branch):
        assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE, params, use_tqdm=False)] == plain
    st = with_branch.engine.proposer
    assert st.branch_tokens > 0 and st.branch_wins > 0, (st.branch_tokens, st.branch_wins)
    assert not hasattr(without.engine.proposer, "branch_tokens")
    # a tiny random model repeats itself: the n-gram branch adds accepted tokens to random drafters'
    assert with_branch.get_metrics()["mean_acceptance_length"] > without.get_metrics()["mean_acceptance_length"]


def test_rows_that_skip_drafting_still_verify_their_branches(tiny_llama, tmp_path):
    """DSpark's draft gate sits a request out of drafting: its n-gram branches still go to verification."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(REPETITIVE, params, use_tqdm=False)]
    spec = {**_drafter("dspark-tree-auto", tiny_llama, tmp_path), **POOLED}
    llm = _verify_all(LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec))
    llm.engine.proposer.inner.gate.skip = lambda seq_id: True  # the gate never lets a request draft
    assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE, params, use_tqdm=False)] == plain
    st = llm.engine.proposer
    assert st.branch_tokens > 0 and st.branch_wins > 0, (st.branch_tokens, st.branch_wins)
    assert llm.get_metrics()["mean_acceptance_length"] > 1.2


def test_the_pool_offers_earlier_requests_continuations(tiny_llama, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[40 + i, 7, 3, 11 + i] for i in range(3)]
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)]
    spec = {**_drafter("medusa-dynamic", tiny_llama, tmp_path), "ngram_branch": 12}
    taus = {}
    for pool in (False, True):
        llm = _verify_all(LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, "ngram_pool": pool}))
        for _ in range(2):  # the second time, the pool holds the first answers
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        taus[pool] = llm.get_metrics()["mean_acceptance_length"]
        assert (llm.engine.proposer.pool is not None) == pool and len(llm.engine.proposer.pool or ()) == 6 * pool
    assert taus[True] > taus[False] + 0.5, taus


@pytest.mark.parametrize("kind,branch", [("medusa", 4), ("dspark-tree", 4), ("medusa-dynamic", POOLED)])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, kind, branch):
    plain = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    branch = {"ngram_branch": branch} if isinstance(branch, int) else branch
    spec = _verify_all(LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64,
                           speculative_config={**_drafter(kind, small_vocab_model, tmp_path), **branch}))
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    st = spec.engine.proposer
    assert st.branch_tokens > 100 and st.branch_wins > 20, (st.branch_tokens, st.branch_wins)  # it played
    assert_same_distribution(a, b)


def test_the_ngram_drafter_verifies_what_its_cost_model_finds_worth(tiny_llama):
    """``{"method": "ngram"}`` (cost model, three continuations, pooled): every token offered is verified
    where verifying costs the same for any count, none where each token more costs 1,000 times the step, and the
    output is plain decoding's either way; vLLM's drafting (``"full"``) verifies every continuation whole
    (a tree when there are several). Drafts never depend on the target's verdict: the same answers."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(REPETITIVE, params, use_tqdm=False)]

    def run(costs=None, **cfg):
        llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={"method": "ngram", **cfg})
        if costs is not None:
            llm.engine.proposer.verify_costs = costs
        for _ in range(2):  # the second time, the pool (where there is one) holds the first answers
            assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE, params, use_tqdm=False)] == plain
        return llm.get_metrics()

    free, dear = run({1: 1.0, 4096: 1.0}), run({n: 1e3 ** n for n in range(1, 65)})
    chain, trees = run(ngram_verify="full"), run(ngram_verify="full", ngram_candidates=3)
    alone = run({1: 1.0, 4096: 1.0}, ngram_pool=False, ngram_candidates=1)
    assert dear["num_draft_tokens"] == 0 and dear["mean_acceptance_length"] == 1.0
    assert free["num_accepted_tokens"] > chain["num_accepted_tokens"] > 0  # the pool and the other candidates
    assert free["num_draft_tokens"] > chain["num_draft_tokens"]
    assert trees["num_draft_tokens"] > chain["num_draft_tokens"]
    assert trees["num_accepted_tokens"] >= chain["num_accepted_tokens"]
    # one continuation of the sequence's own, verified whole: the same drafts as vLLM's
    assert alone["num_draft_tokens"] == chain["num_draft_tokens"]
    assert alone["num_accepted_tokens"] == chain["num_accepted_tokens"]
