"""Sampling: seeded reproducibility across batch compositions, top-k/top-p/min-p masks, stops."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers import cpu_ops
from specserve.sample.sampler import SamplingBatch, draw, filtered_logits, inverse_cdf, sample, uniforms


def _batch(params, seed=0):
    return SamplingBatch.build(params, [torch.Generator().manual_seed(seed + i) for i in range(len(params))])


@pytest.mark.parametrize("top_k", [1, 5, 99])
def test_top_k_never_emits_masked(top_k):
    torch.manual_seed(0)
    logits = torch.randn(100, 100)
    sb = _batch([SamplingParams(temperature=1.0, top_k=top_k)] * 100)
    allowed = logits.topk(top_k, dim=-1).indices
    for _ in range(20):
        t = sample(logits, sb)
        assert (allowed == t.unsqueeze(-1)).any(-1).all()


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_never_emits_masked(top_p):
    torch.manual_seed(1)
    logits = torch.randn(100, 100) * 2
    sb = _batch([SamplingParams(temperature=0.8, top_p=top_p)] * 100)
    probs = (logits / 0.8).softmax(-1)
    sp, si = probs.sort(-1, descending=True)
    keep_sorted = (sp.cumsum(-1) - sp) < top_p
    allowed = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, si, keep_sorted)
    for _ in range(20):
        t = sample(logits, sb)
        assert allowed.gather(-1, t.unsqueeze(-1)).all()


def test_min_p_and_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    f = filtered_logits(logits, _batch([SamplingParams(min_p=0.2)]))
    assert torch.isinf(f[0, 3]) and torch.isfinite(f[0, :3]).all()  # 0.05 < 0.2 * 0.5
    sb = _batch([SamplingParams(temperature=1.0)] * 20000)
    counts = torch.bincount(sample(logits.expand(20000, 4), sb), minlength=4).float() / 20000
    assert (counts - torch.tensor([0.5, 0.3, 0.15, 0.05])).abs().max() < 0.015


def test_inverse_cdf_draws_from_p_and_never_a_zero_token():
    """Every draw (plain sampling, rejection sampling, trees, DSpark's sampled drafts) is one uniform and
    a float64 running sum: frequencies match p (chi-square), a token with no mass is never drawn (also
    when u x total rounds up to the total), the sums resolve a 1e-9 share next to 0.5 (a float32 sum
    would give it no width), rows of a batch draw independently, the generator decides the draw."""
    p = torch.zeros(50)
    p[[3, 7, 8, 20, 41]] = torch.tensor([0.05, 0.4, 0.15, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = inverse_cdf(p.expand(n, 50), uniforms(n, g))
    assert draws.shape == (n,) and draws.dtype == torch.long
    counts = torch.bincount(draws, minlength=50).double()
    assert counts[p == 0].sum() == 0
    expected = n * p.double()
    chi2 = float(((counts - expected)[p > 0] ** 2 / expected[p > 0]).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p-value 0.001
    # unnormalised rows, one at a time (0-d) and in a batch: row i's draw depends on u_i only
    one = [int(inverse_cdf(p * 3.0, torch.tensor(x, dtype=torch.float64))) for x in (0.0, 0.06, 0.5, 0.99)]
    assert one == [3, 7, 8, 41]
    rows = torch.stack([p, p.flip(0), p])
    assert inverse_cdf(rows, torch.tensor([0.06, 0.06, 0.5])).tolist() == [7, 8, 8]
    # u x total reaching the total: the last token with mass, not the zero tail after it nor past the end
    assert int(inverse_cdf(p * 3.0, torch.tensor(1.0))) == 41
    # float64 sums: a 1e-9 share right after 0.5 keeps its width
    tiny = torch.tensor([0.5, 1e-9, 0.5])
    assert int(inverse_cdf(tiny, torch.tensor(0.5 + 2.5e-10, dtype=torch.float64))) == 1
    assert int(inverse_cdf(tiny, torch.tensor(0.5 + 2e-9, dtype=torch.float64))) == 2
    a = [int(inverse_cdf(p, uniforms(1, torch.Generator().manual_seed(s))[0])) for s in range(20)]
    assert a == [int(inverse_cdf(p, uniforms(1, torch.Generator().manual_seed(s))[0])) for s in range(20)]
    assert len(set(a)) > 1


@pytest.mark.skipif(cpu_ops.get() is None, reason="the C++ extension did not build here (the fallback runs)")
def test_draw_op_is_the_inverse_cdf_of_the_filtered_softmax(monkeypatch):
    """``draw``'s C++ op (rows without top-k and top-p on a CPU): the token of ``inverse_cdf`` over
    ``filtered_logits``' softmax for the same uniform, at temperatures and min-p values, vocabularies whose
    size is no multiple of the op's blocks, u = 0 and u just under 1; draws from p (chi-square), never a token
    under min-p; and each row takes its rule by its own settings, whatever shares the call."""
    g = torch.Generator().manual_seed(0)
    for V, n in ((49152, 300), (1, 20), (17, 200), (100, 400), (257, 200)):
        logits = torch.randn(n, V, generator=g) * 4
        temps, min_ps = torch.rand(n, generator=g) * 1.5 + 0.1, torch.rand(n, generator=g) * 0.3
        params = [SamplingParams(temperature=float(t), min_p=float(m) if i % 3 == 0 else 0.0)
                  for i, (t, m) in enumerate(zip(temps, min_ps))]
        params[:2] = [SamplingParams(temperature=1.0)] * min(n, 2)  # no weight below exp(-87) (the op's 0)
        sb = _batch(params)
        u = torch.rand(n, generator=g, dtype=torch.float64)
        u[:2] = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)[: min(n, 2)]
        want = inverse_cdf(filtered_logits(logits, sb).softmax(-1), u)
        got = cpu_ops.inverse_cdf_draws(logits, sb.temperature, sb.min_p, u)
        assert got.tolist() == want.tolist(), V
    # the tail that no draw may reach: no mass past the last kept token, none below min-p
    logits = torch.full((2, 40), -30.0)
    logits[:, [3, 7, 8]] = torch.tensor([2.0, 3.0, 0.2])
    last = torch.tensor([1 - 2**-53, 1 - 2**-53], dtype=torch.float64)
    assert cpu_ops.inverse_cdf_draws(logits, torch.ones(2), torch.tensor([0.0, 0.1]), last).tolist() == [39, 7]
    p = (logits[0] / 0.7).softmax(-1)
    n = 20000
    sb = _batch([SamplingParams(temperature=0.7, min_p=0.05)] * n)
    counts = torch.bincount(draw(logits[:1].expand(n, 40), sb, uniforms(n, g)), minlength=40).double()
    kept = p >= 0.05 * p.max()
    assert counts[~kept].sum() == 0
    expected = n * p[kept].double() / p[kept].sum()
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < 13.8  # 2 degrees of freedom, p 0.001
    # routing: a row with top-k or top-p goes to the PyTorch rule, the others to the op, in any company
    seen = []
    op = cpu_ops.inverse_cdf_draws
    monkeypatch.setattr(cpu_ops, "inverse_cdf_draws", lambda x, *a: seen.append(x.shape[0]) or op(x, *a))
    mixed = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.8),
             SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=1.3, min_p=0.1)]
    logits = torch.randn(4, 300, generator=g)
    u = torch.rand(4, generator=g, dtype=torch.float64)
    together = draw(logits, _batch(mixed), u).tolist()
    assert seen == [2]
    alone = [int(draw(logits[i : i + 1], _batch([mixed[i]]), u[i : i + 1])[0]) for i in range(4)]
    assert together == alone and seen == [2, 1, 1]


def test_seeded_request_same_output_in_any_batch(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=s % 7 + 3, ignore_eos=True) for s in range(5)]
    batch = llm.generate([[9, 9], [1, 2, 3, 4, 5], [5, 6, 7], [30], [8] * 11, [100, 3]],
                         [others[0], others[1], p, others[2], others[3], others[4]], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate([[5, 6, 7]], p.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_stop_conditions(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    base = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    assert base.outputs[0].finish_reason == "length" and len(ids) == 20
    # stop token id: generation ends at its first occurrence (the token is kept)
    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[ids[4]]), use_tqdm=False)[0].outputs[0]
    first = ids.index(ids[4])
    assert o.token_ids == ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == ids[4]
    # stop string: the text is cut before it
    word = f"w{ids[6]}"
    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[word]),
                     use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == word and word not in o.text
    assert base.outputs[0].text.startswith(o.text)
    # EOS (id 0 here) ends generation unless ignore_eos
    with_eos = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[]),
                            use_tqdm=False)[0].outputs[0]
    if 0 in ids:
        assert with_eos.token_ids == ids[: ids.index(0) + 1] and with_eos.finish_reason == "stop"
    else:
        assert with_eos.token_ids == ids


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
