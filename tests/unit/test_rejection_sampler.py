"""Rejection sampler: vLLM V1 semantics (greedy table, convergence to the target distribution,
seeded determinism, top-k/top-p, vocab boundaries). CPU only, fixed seeds."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.config import SamplingParams
from specserve.sample import rejection_sampler as rs
from specserve.sample.rejection_sampler import PLACEHOLDER, accepted_counts, parse_output, rejection_sample
from specserve.sample.sampler import SamplingBatch




def make_sb(params: list[SamplingParams], seeds: list[int] | None = None) -> SamplingBatch:
    seeds = seeds if seeds is not None else list(range(len(params)))
    return SamplingBatch.build(params, [torch.Generator().manual_seed(s) for s in seeds])


def greedy_sb(n: int) -> SamplingBatch:
    return make_sb([SamplingParams(temperature=0.0)] * n)


def onehot_logits(targets: list[list[int]], width: int, V: int = 16) -> torch.Tensor:
    """-100 everywhere, +100 on the intended token (vLLM's test construction)."""
    logits = torch.full((len(targets), width, V), -100.0)
    for b, row in enumerate(targets):
        for j, t in enumerate(row):
            logits[b, j, t] = 100.0
    return logits


# (drafts, target argmax per position incl. the bonus position, expected output)
GREEDY_CASES = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4, 9]], [[1, 2, 5], [3, 4, -1]]),
    "single_token": ([[1]], [[1, 2]], [[1, 2]]),
    "empty": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 7]], [[1, 2, 7, -1], [4, 8, -1, -1]]),
    "first_position_mismatch": ([[1]], [[2, 3]], [[2, -1]]),
    "mixed_lengths": ([[1, 2, 3], [], [4, 5]], [[1, 2, 3, 6], [7, 0, 0, 0], [4, 9, 1, 0]],
                      [[1, 2, 3, 6], [7, -1, -1, -1], [4, 9, -1, -1]]),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_table(case, monkeypatch):
    drafts, targets, expected = GREEDY_CASES[case]
    width = max(len(d) for d in drafts) + 1
    logits = onehot_logits(targets, width)

    # greedy-only batches take the fast path: no filtering / softmax at all
    def boom(*a, **k):
        raise AssertionError("greedy fast path must not compute probabilities")

    monkeypatch.setattr(rs, "filtered_logits", boom)
    out = rejection_sample(drafts, None, logits, greedy_sb(len(drafts)))
    assert out.dtype == torch.int64
    assert out.tolist() == expected
    # draft probs are irrelevant for greedy rows
    dp = torch.rand(len(drafts), width - 1, logits.shape[-1])
    assert rejection_sample(drafts, dp, logits, greedy_sb(len(drafts))).tolist() == expected


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_rows_in_mixed_batch(case):
    """The same greedy rows next to a random row give the same result (mixed path)."""
    drafts, targets, expected = GREEDY_CASES[case]
    width = max(len(d) for d in drafts) + 1
    V = 16
    logits = onehot_logits(targets, width, V)
    extra = torch.randn(1, width, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * len(drafts) + [SamplingParams(temperature=1.0)]
    out = rejection_sample(drafts + [[0] * (width - 1)], None, torch.cat([logits, extra]), make_sb(params))
    assert out[:-1].tolist() == expected
    row = out[-1].tolist()
    n = sum(t != PLACEHOLDER for t in row)
    assert n >= 1 and all(0 <= t < V for t in row[:n]) and all(t == PLACEHOLDER for t in row[n:])


@pytest.mark.parametrize("sampling_mode", ["rejection", "coupled"])
def test_engine_verifier_greedy_chains_match_the_sampler(sampling_mode):
    """The engine's ``Verifier`` checks greedy chain rows itself (one argmax, no sampling tensors): every
    greedy table's rows give what ``rejection_sample`` gives them, with random rows in the same batch
    (theirs: what they get alone), and NaN logits past a row's bonus position do not matter."""
    from types import SimpleNamespace

    from specserve.engine.verify import Drafts, Verifier

    for case, (drafts, targets, expected) in GREEDY_CASES.items():
        width = max(len(d) for d in drafts) + 1
        V = 16
        logits = onehot_logits(targets, width, V)
        for b, d in enumerate(drafts):
            logits[b, len(d) + 1:] = float("nan")
        extra = torch.randn(2, width, V, generator=torch.Generator().manual_seed(1))
        greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)
        params = [hot] + [greedy] * len(drafts) + [hot]
        chains = [[0] * (width - 1)] + drafts + [[2] * (width - 1)]
        seqs = [SimpleNamespace(params=p, generator=torch.Generator().manual_seed(7 + b), seed=3, all_ids=[1, 2],
                                output_ids=[2]) for b, p in enumerate(params)]
        out = Verifier(sampling_mode, None, None).verify(seqs, Drafts(chains, [None] * len(chains)),
                                                         [0] * len(chains), torch.cat([extra[:1], logits, extra[1:]]))
        want = [[t for t in row if t != PLACEHOLDER] for row in expected]
        assert [e for e, _ in out[1:-1]] == want, case
        assert [k for _, k in out[1:-1]] == [list(range(len(w))) for w in want], case
        alone = [Verifier(sampling_mode, None, None).verify(
            [SimpleNamespace(**{**vars(seqs[b]), "generator": torch.Generator().manual_seed(7 + b)})],
            Drafts([chains[b]], [None]), [0], extra[i : i + 1])[0] for i, b in ((0, 0), (1, len(seqs) - 1))]
        assert [out[0], out[-1]] == alone, case


def test_greedy_ignores_logits_past_bonus():
    # row 1 has 1 draft; its positions 2.. hold NaN and must not matter
    logits = onehot_logits([[1, 2, 3], [4, 5, 0]], 3)
    logits[1, 2] = float("nan")
    out = rejection_sample([[1, 2], [4]], None, logits, greedy_sb(2))
    assert out.tolist() == [[1, 2, 3], [4, 5, -1]]
    sb = make_sb([SamplingParams(temperature=1.0)] * 2)
    out = rejection_sample([[1, 2], [4]], None, logits, sb)  # +-100 logits: p is one-hot in float32
    assert out.tolist() == [[1, 2, 3], [4, 5, -1]]


def test_helpers():
    out = torch.tensor([[1, 2, 3, 4], [1, 5, -1, -1], [7, -1, -1, -1]])
    assert accepted_counts(out) == [3, 1, 0]
    assert parse_output(out) == [[1, 2, 3, 4], [1, 5], [7]]
    assert parse_output(torch.tensor([[3, 12, -1]]), vocab_size=10) == [[3]]


# --------------------------------------------------------------------------------- distribution


def _estimate_pdf(q: torch.Tensor, target_probs: torch.Tensor, k: int, n: int, with_q: bool, seed: int) -> torch.Tensor:
    """Histogram of the tokens emitted at non-bonus columns over n sequences (one call, B = n)."""
    V = q.shape[0]
    gd = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n * k, replacement=True, generator=gd).view(n, k)
    logits = target_probs.log().expand(n, k + 1, V)
    dp = q.expand(n, k, V) if with_q else None
    pool = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(8)]
    sb = SamplingBatch.build([SamplingParams(temperature=1.0)] * n, [pool[i % len(pool)] for i in range(n)])
    out = rejection_sample(drafts.tolist(), dp, logits, sb)
    toks = out[:, :-1].flatten()
    toks = toks[toks != PLACEHOLDER]
    assert toks.numel() > 0 and int(toks.min()) >= 0 and int(toks.max()) < V
    return torch.bincount(toks, minlength=V).float() / toks.numel()


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampling_approximates_target_distribution(with_q):
    V, k, num_ref = 10, 2, 100
    g = torch.Generator().manual_seed(7)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    target = torch.softmax(torch.randn(V, generator=g), -1)
    reference = torch.softmax(torch.randn(num_ref, V, generator=g), -1)
    assert torch.dist(q, target).item() > 0.1  # accepting drafts blindly would be far off

    d_target, d_ref = [], []
    for i, n in enumerate([10, 100, 1_000, 10_000, 100_000]):
        est = _estimate_pdf(q, target, k, n, with_q, seed=100 + i)
        d_target.append(torch.dist(target, est).item())
        d_ref.append(torch.dist(reference, est).item() / num_ref)
    ratio_target = d_target[0] / d_target[-1]
    ratio_ref = d_ref[0] / d_ref[-1]
    assert ratio_target > 20 * ratio_ref, (d_target, d_ref)
    assert d_target[-1] < 0.01, d_target


@pytest.mark.parametrize("with_q", [True, False])
def test_acceptance_rate(with_q):
    """P(accept draft 0) = sum_x min(p(x), q(x)) with q, and sum_x q(x) p(x) for one-hot drafts."""
    V, n = 6, 40_000
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(2 * torch.randn(V, generator=g), -1)
    p = torch.softmax(2 * torch.randn(V, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    pool = [torch.Generator().manual_seed(50 + i) for i in range(4)]
    sb = SamplingBatch.build([SamplingParams()] * n, [pool[i % 4] for i in range(n)])
    out = rejection_sample(drafts.tolist(), q.expand(n, 1, V) if with_q else None, p.log().expand(n, 2, V), sb)
    rate = sum(accepted_counts(out)) / n
    expect = torch.minimum(p, q).sum().item() if with_q else (p * q).sum().item()
    assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n) + 1e-3, (rate, expect)
    # the first emitted token is an exact sample of p either way
    hist = torch.bincount(out[:, 0], minlength=V).float() / n
    assert (hist - p).abs().max().item() < 0.015


@pytest.mark.parametrize("with_q", [True, False])
def test_bonus_distribution(with_q):
    """Rows that accept every draft append a sample of p at the bonus position (not of p - q)."""
    V, n = 6, 30_000
    g = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    p0 = torch.softmax(torch.randn(V, generator=g), -1)
    p1 = torch.softmax(2 * torch.randn(V, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    logits = torch.stack([p0.log(), p1.log()]).expand(n, 2, V)
    pool = [torch.Generator().manual_seed(70 + i) for i in range(4)]
    sb = SamplingBatch.build([SamplingParams()] * n, [pool[i % 4] for i in range(n)])
    out = rejection_sample(drafts.tolist(), q.expand(n, 1, V) if with_q else None, logits, sb)
    bonus = out[:, 1][out[:, 1] != PLACEHOLDER]
    assert 0.1 * n < bonus.numel() < 0.9 * n  # a mix of accepted and rejected rows
    hist = torch.bincount(bonus, minlength=V).float() / bonus.numel()
    assert (hist - p1).abs().max().item() < 0.02, (hist, p1)


def test_zero_probability_drafts_rejected_and_certain_drafts_accepted():
    V, n = 8, 200
    p = torch.tensor([0.0, 0.5, 0.5, 0, 0, 0, 0, 0])
    logits = p.log().expand(n, 2, V)  # -inf outside {1, 2}
    sb = make_sb([SamplingParams()] * n)
    q = torch.full((n, 1, V), 1.0 / V)
    for dp in (q, None):
        out = rejection_sample([[0]] * n, dp, logits, sb)
        assert accepted_counts(out) == [0] * n
        assert set(out[:, 0].tolist()) == {1, 2}
    # q(x) == 0 is always a rejection, even where p(x) > 0
    q0 = torch.full((n, 1, V), 1.0 / 7)
    q0[:, :, 1] = 0
    out = rejection_sample([[1]] * n, q0, logits, sb)
    assert accepted_counts(out) == [0] * n
    # a draft with p(x) = 1 is always accepted (without draft probs), the bonus comes from p
    one = torch.full((n, 2, V), float("-inf"))
    one[:, 0, 3] = 0.0
    one[:, 1, 5] = 0.0
    out = rejection_sample([[3]] * n, None, one, sb)
    assert out.tolist() == [[3, 5]] * n


# ------------------------------------------------------------------------------- determinism


def test_deterministic_when_seeded():
    V, width = 1000, 6
    probe_logits = torch.randn(width, V, generator=torch.Generator().manual_seed(1)) * 0.5
    probe_drafts = probe_logits[:5].argsort(-1, descending=True)[:, 3].tolist()  # plausible, often rejected
    probe_q = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(2)), -1)
    rng = random.Random(0)
    for with_q in (True, False):
        results, unseeded = set(), set()
        for rep in range(20):
            B = rng.choice([1, 4, 8])
            pos = rng.randrange(B)
            logits = torch.randn(B, width, V) * 0.5
            dp = torch.softmax(torch.randn(B, width - 1, V), -1)
            drafts, params, seeds = [], [], []
            for b in range(B):
                drafts.append([rng.randrange(V) for _ in range(rng.choice([0, 1, 3, 5]))])
                params.append(SamplingParams(temperature=rng.choice([0.0, 0.8, 1.0])))
                seeds.append(rng.randrange(1 << 30))
            logits[pos], dp[pos], drafts[pos] = probe_logits, probe_q, list(probe_drafts)
            params[pos], seeds[pos] = SamplingParams(temperature=1.3, top_p=0.95, seed=42), 42
            # an unseeded twin of the probe (fresh entropy) shows that outputs do vary
            logits = torch.cat([logits, probe_logits[None]])
            dp = torch.cat([dp, probe_q[None]])
            drafts.append(list(probe_drafts))
            params.append(SamplingParams(temperature=1.3, top_p=0.95))
            seeds.append(rng.randrange(1 << 30))
            out = rejection_sample(drafts, dp if with_q else None, logits, make_sb(params, seeds))
            results.add(tuple(out[pos].tolist()))
            unseeded.add(tuple(out[-1].tolist()))
        assert len(results) == 1, results
        assert len(unseeded) > 1


def test_shared_generator_rows_are_valid():
    """Rows sharing one generator object (SamplingBatch.repeat) draw distinct randomness."""
    V, n = 50, 64
    sb = make_sb([SamplingParams()], [0]).repeat([n])
    logits = torch.zeros(n, 1, V)  # uniform p, only the bonus position
    out = rejection_sample([[]] * n, None, logits, sb)
    assert len(set(out[:, 0].tolist())) > 20


# ------------------------------------------------------------------------------ top-k / top-p


def _allowed_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    idx = logits.topk(k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)


def _allowed_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = logits.double().softmax(-1)
    sp, si = probs.sort(-1, descending=True)
    before = sp.cumsum(-1) - sp
    keep = before < top_p
    keep[..., 0] = True
    return torch.zeros_like(keep).scatter_(-1, si, keep)


def _check_allowed(out: torch.Tensor, allowed: torch.Tensor) -> None:
    B, W = out.shape
    for b in range(B):
        for j in range(W):
            t = int(out[b, j])
            if t == PLACEHOLDER:
                assert (out[b, j:] == PLACEHOLDER).all()
                break
            assert bool(allowed[b, j, t]), (b, j, t)


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("kind,value", [("top_k", 1), ("top_k", 5), ("top_k", 99),
                                        ("top_p", 0.5), ("top_p", 0.9), ("top_p", 0.99)])
def test_top_k_top_p(kind, value, with_q):
    V, B, k = 100, 100, 3
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, k + 1, V, generator=g) * 3
    # drafts: half from the target's top tokens (so some get accepted), half uniform
    top = logits[:, :k].argmax(-1)
    uni = torch.randint(0, V, (B, k), generator=g)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.5, top, uni)
    dp = torch.softmax(torch.randn(B, k, V, generator=g), -1) if with_q else None
    params = SamplingParams(**{kind: value})
    out = rejection_sample(drafts.tolist(), dp, logits, make_sb([params] * B))
    allowed = _allowed_top_k(logits, value) if kind == "top_k" else _allowed_top_p(logits, value)
    _check_allowed(out, allowed)
    if value not in (1, 0.5):
        assert sum(accepted_counts(out)) > 0


# ------------------------------------------------------------------------------ vocab boundary


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("V", [100, 8193, 10000])
def test_vocab_boundary(V, with_q):
    B, k = 32, 3
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(B, k + 1, V, generator=g)
    # mass at the very last ids, so recovered tokens land near V - 1
    logits[:, :, V - 3:] += 8.0
    drafts = torch.randint(0, V, (B, k), generator=g).tolist()
    for b in range(0, B, 4):
        drafts[b][0] = -1
    for b in range(1, B, 4):
        drafts[b][0] = V
    for b in range(2, B, 4):
        drafts[b][0] = V + 1000
    dp = torch.softmax(torch.randn(B, k, V, generator=g), -1) if with_q else None
    out = rejection_sample(drafts, dp, logits, make_sb([SamplingParams()] * B))
    assert out.shape == (B, k + 1)
    for b in range(B):
        row = out[b].tolist()
        n = sum(t != PLACEHOLDER for t in row)
        assert n >= 1 and all(t == PLACEHOLDER for t in row[n:])
        assert all(0 <= t < V for t in row[:n]), row
        if b % 4 != 3:  # invalid first draft: rejected at position 0
            assert n == 1
    assert max(int(t) for t in out[:, 0]) >= V - 3  # the top ids are reachable


@pytest.mark.parametrize("V", [100, 8193, 10000])
def test_recovered_at_last_id(V):
    """p one-hot on V - 1 (V not a multiple of 8): the recovered token is exactly V - 1."""
    B = 4
    logits = torch.full((B, 2, V), -50.0)
    logits[:, :, V - 1] = 50.0
    for dp in (None, torch.full((B, 1, V), 1.0 / V)):
        out = rejection_sample([[0], [-1], [V], [V - 2]], dp, logits, make_sb([SamplingParams()] * B))
        assert out.tolist() == [[V - 1, -1]] * B
    greedy = rejection_sample([[0], [-1], [V], [V - 1]], None, logits, greedy_sb(B))
    assert greedy.tolist() == [[V - 1, -1]] * 3 + [[V - 1, V - 1]]


def test_shape_errors():
    sb = greedy_sb(1)
    with pytest.raises(ValueError):
        rejection_sample([[1, 2]], None, torch.zeros(1, 2, 8), sb)  # 2 drafts, 2 positions
    with pytest.raises(ValueError):
        rejection_sample([[1], [2]], None, torch.zeros(1, 2, 8), sb)
    with pytest.raises(ValueError):
        rejection_sample([[1]], torch.zeros(1, 1, 7), torch.zeros(1, 2, 8), make_sb([SamplingParams()]))
