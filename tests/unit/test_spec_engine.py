"""The speculative engine loop: chains and trees through the real runner are lossless."""

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ModelRunner
from specserve.sample.tree import TreeBuffers, verify_tree_greedy
from specserve.spec_decode import PROPOSERS, Proposal, Proposer, TreeDraft
from specserve.spec_decode.ngram.index import NgramIndex, NgramPool, ngram_propose
from specserve.spec_decode.options import option

PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]


def test_ngram_propose():
    ids = torch.tensor([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2])
    assert ngram_propose(ids, 3, 4, 1) == [3, 7, 8]  # the most recent earlier match of [1, 2]
    assert ngram_propose(ids, 2, 4, 3) == []  # no earlier [3, 1, 2]... -> nothing at n >= 3
    assert ngram_propose(torch.tensor([5, 6, 5]), 4, 2, 1) == [6, 5]
    assert ngram_propose(torch.tensor([5]), 4, 2, 1) == []


def _scan_candidates(ids: list[int], k: int, limit: int, pool, n_max: int, n_min: int) -> list[tuple[list[int], int]]:
    """The n-gram branches' rule read off a scan of the whole sequence at every n (the reference)."""
    out, L = [], len(ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n :]
        found = [ids[h + n : h + n + k] for h in range(L - n - 1, -1, -1) if ids[h : h + n] == suffix]
        for tokens in found + (pool.continuations(suffix, k) if pool is not None else []):
            if tokens and not any(c[: len(tokens)] == tokens for c, _ in out):
                out.append((tokens, n))
            if len(out) >= limit:
                return out
    return out


def test_ngram_index_grown_step_by_step_finds_what_a_scan_finds():
    """``NgramIndex`` updated as a sequence grows (a few tokens a step, as decoding appends them) offers
    the continuations a scan of the whole sequence offers, in the same order, pool included; a sequence
    that is not the indexed one grown is indexed anew."""
    g = torch.Generator().manual_seed(0)
    pool = NgramPool()
    for _ in range(3):
        pool.add(torch.randint(0, 5, (60,), generator=g).tolist())
    for n_max, n_min in ((4, 1), (3, 2)):
        seq = torch.randint(0, 5, (300,), generator=g).tolist()
        index, L = NgramIndex(n_max, n_min), 0
        while L < len(seq):
            L += 1 + int(torch.randint(0, 4, (1,), generator=g))
            for k, limit, p in ((12, 3, pool), (5, 1, None), (3, 8, None)):
                assert index.update(seq[:L]).candidates(k, limit, p) == _scan_candidates(seq[:L], k, limit, p,
                                                                                         n_max, n_min), L
        for other in ([4, 4, 1, 2, 4, 4, 1], [(t + 1) % 5 for t in seq] + [1, 2]):  # shorter; longer, not grown
            assert index.update(other).candidates(9, 8) == _scan_candidates(other, 9, 8, None, n_max, n_min)


def chi2_critical(dof: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3


def two_sample_chi2(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    """Chi-square homogeneity statistic of two samples (rare outcomes pooled) and its dof."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=str)
    bins, rare = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= min_count:
            bins.append((a[k], b[k]))
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare):
        bins.append(tuple(rare))
    stat = 0.0
    for x, y in bins:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(bins) - 1


def sample_prefixes(llm, n, seed0, prompt=PROMPT, k=3):
    params = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=k, ignore_eos=True) for i in range(n)]
    outs = llm.generate([list(prompt)] * n, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids) for o in outs)


def assert_same_distribution(a: Counter, b: Counter) -> None:
    """Two-sample chi-square at p = 0.001 on the whole prefix and on each position's marginal."""
    k = len(next(iter(a)))
    for view in (lambda t: t, *[(lambda j: lambda t: t[j])(j) for j in range(k)]):
        ca, cb = Counter(), Counter()
        for c, src in ((ca, a), (cb, b)):
            for t, n in src.items():
                c[view(t)] += n
        stat, dof = two_sample_chi2(ca, cb)
        if dof:  # a view whose outcomes are all rare pools into one bin: nothing to compare
            assert stat < chi2_critical(dof), (stat, dof)


@dataclass(frozen=True)
class OracleOptions:
    num_speculative_tokens: int = option(3, "tree depth", lo=3, hi=3)
    model: str | None = option(None, "the target's checkpoint (the oracle's copy)")


class OracleTreeProposer(Proposer):
    """Test drafter: a tree whose *second* branch follows the target's own greedy continuation (from
    a copy of the target) and whose other branches are random, so that accepted paths skip nodes
    and the KV compaction is exercised."""

    name = "oracle-tree"
    Options = OracleOptions

    def __init__(self, opts: OracleOptions):
        self.num_speculative_tokens = opts.num_speculative_tokens
        self.oracle = ModelRunner(opts.model, dtype="float32", max_num_seqs=1)
        # root; children 1 (random), 2 (oracle); 2 -> 3 (oracle), 4 (random); 3 -> 5 (oracle)
        self.buffers = TreeBuffers.from_parents([-1, 0, 0, 2, 2, 3])
        self.gen = torch.Generator().manual_seed(0)

    def _greedy(self, ids, n):
        out = []
        for _ in range(n):
            logits = self.oracle.forward(0, [ids + out], [0], "last").logits[0]
            out.append(int(logits.argmax()))
        return out

    def propose(self, inputs):
        trees = []
        V = self.oracle.config.vocab_size
        for s, k in zip(inputs.seqs, inputs.max_drafts):
            if k < 3:
                trees.append(None)
                continue
            g = self._greedy(s.all_ids, 3)
            r = torch.randint(0, V, (3,), generator=self.gen).tolist()
            trees.append(TreeDraft([s.output_ids[-1], r[0], g[0], g[1], r[1], g[2]], self.buffers))
        return Proposal([[] for _ in inputs.seqs], trees=trees)


def sampled_walk(llm, prompt, steps, max_tokens=60):
    """Generate ``prompt`` at temperature 1 (a sampled target: with greedy drafts some steps accept
    part of their drafts, some none) while ``steps`` collects ``(start, drafts)`` of every drafting
    step (start: the anchor's position). Returns prompt + output ids, after checking that partial
    acceptances happened and that each step starts right after the previous one's accepted drafts and
    its bonus token."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    full = prompt + list(out.outputs[0].token_ids)
    accepted = []
    for start, drafts in steps:
        n = 0
        while n < len(drafts) and start + 1 + n < len(full) and drafts[n] == full[start + 1 + n]:
            n += 1
        accepted.append(n)
    assert any(0 < n < len(d) for n, (_, d) in zip(accepted, steps))  # partial acceptances happened
    assert [s for s, _ in steps[1:]] == [s + n + 1 for (s, _), n in zip(steps, accepted)][:-1]
    return full


@pytest.fixture
def oracle_tree_registered():
    PROPOSERS["oracle-tree"] = OracleTreeProposer
    yield
    PROPOSERS.pop("oracle-tree")


def test_tree_drafts_greedy_identical_and_accepted(tiny_llama, oracle_tree_registered):
    prompts = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "oracle-tree", "num_speculative_tokens": 3, "model": str(tiny_llama)})
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    m = llm.get_metrics()
    # 19 tokens after the prefill: 4 steps accept the whole oracle branch (4 tokens each), the last 3
    # tokens leave no budget for a 3-deep tree and go one per step: 19 / 7
    assert m["mean_acceptance_length"] == pytest.approx(19 / 7)


def test_tree_compaction_equals_plain_cache(tiny_llama):
    """After verifying a tree and compacting the accepted path, the cache equals the cache that
    plainly decoding the accepted tokens builds, and decoding continues with the same logits."""
    r = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    n = len(PROMPT)
    r.forward(0, [PROMPT[:-1]], [0], "none")
    ref = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    g = []
    for _ in range(2):
        g.append(int(ref.forward(0, [PROMPT + g], [0], "last").logits[0].argmax()))
    buffers = TreeBuffers.from_parents([-1, 0, 0, 2, 1])
    tokens = [PROMPT[-1], (g[0] + 1) % 257, g[0], g[1], 7]
    out = r.forward(0, [tokens], [n - 1], "all", tree_mask=[buffers.attn_mask],
                    positions=[(buffers.depth + n - 1).tolist()]).logits[0]
    nodes, extra = verify_tree_greedy(torch.tensor(tokens), out, buffers)
    assert nodes == [0, 2, 3]
    r.compact(0, [n - 1 + i for i in nodes], n - 1)
    plain = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    plain.forward(0, [PROMPT + g], [0], "none")
    L = n + 2
    for layer in range(len(r.kv.kv)):
        assert torch.allclose(r.kv.sequence(0, layer, L), plain.kv.sequence(0, layer, L), atol=1e-5)
    a = r.forward(0, [[extra]], [L], "last").logits
    b = plain.forward(0, [[extra]], [L], "last").logits
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("quantization,verify", [(None, "full"), ("int4", "full"), (None, "auto")])
def test_ngram_distribution_matches_plain_sampling(small_vocab_model, quantization, verify):
    """Temperature 1: the first 4 tokens sampled with n-gram drafting have the distribution of plain
    sampling (two-sample chi-square over 2,000 seeded samples each), with dense float32 weights and with
    int4 weights (the rejection sampler over a quantized target); vLLM's drafting (one continuation,
    all verified) and the default's (trees of three continuations, pooled from earlier requests, chosen
    by the cost model: verifying made free here, so that it verifies them all)."""
    kw = dict(model=str(small_vocab_model), max_num_seqs=64, quantization=quantization,
              dtype="auto" if quantization else "float32", **({"device": "cpu"} if quantization else {}))
    # (weight-only quantization runs on the CPU only: pinned there on a machine with a GPU)
    plain = LLM(sampling_mode="rejection", **kw)
    spec = LLM(sampling_mode="rejection", **kw,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                   "ngram_verify": verify})
    if verify == "auto":
        assert spec.engine.proposer.source.pool is not None and spec.engine.proposer.source.limit == 3
        spec.engine.proposer.verify_costs = {1: 1.0, 4096: 1.0}
    a = sample_prefixes(plain, 2000, 0, k=4)
    b = sample_prefixes(spec, 2000, 100_000, k=4)
    m = spec.get_metrics()
    assert m["num_draft_tokens"] > 1000 and m["num_accepted_tokens"] > 100  # drafts really were verified
    assert two_sample_chi2(a, b)[1] >= 10
    assert_same_distribution(a, b)


def test_tree_distribution_matches_plain_sampling(small_vocab_model, oracle_tree_registered):
    plain = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    spec = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64,
               speculative_config={"method": "oracle-tree", "num_speculative_tokens": 3,
                                   "model": str(small_vocab_model)})
    # 5 tokens: the first comes from the prefill, the next step verifies a 3-deep tree
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    assert spec.get_metrics()["num_accepted_tokens"] > 500
    assert_same_distribution(a, b)
