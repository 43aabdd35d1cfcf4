"""Logprobs of emitted tokens: the target's log-softmax, the same with and without a drafter."""

import math

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.sequence import top_alternatives

pytestmark = pytest.mark.slow

PROMPTS = ["List the days of the week: Monday, Tuesday,", "Count from 1 to 15: 1, 2, 3, 4, 5,", "Hi"]


def _logprobs(llm, params):
    out = []
    for p in PROMPTS:
        seq = llm.engine.add_request(llm.tokenizer.encode(p), params, p)
        while not seq.finished:
            llm.engine.step()
        out.append((seq.output_ids, seq.logprobs))
    return out


@pytest.fixture(scope="module")
def plain(real_threads):
    llm = LLM(num_threads=real_threads)  # the default model's own weights: batch-invariant, so drafts change nothing
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                                  {"method": "medusa"}, {"method": "dspark"}])
def test_logprobs_same_with_a_drafter(plain, spec, real_threads):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)
    base = _logprobs(plain, params)
    for ids, lps in base:
        assert len(lps) == len(ids)
        for t, (lp, top) in zip(ids, lps):
            assert len(top) == 3 and top[0][0] == t and math.isclose(top[0][1], lp)  # greedy: the argmax
            assert lp <= 0 and top[0][1] >= top[1][1] >= top[2][1]
    llm = LLM(num_threads=real_threads, speculative_config=spec)
    try:
        got = _logprobs(llm, params)
        assert llm.get_metrics()["num_accepted_tokens"] > 0  # some tokens came from accepted drafts
    finally:
        llm.shutdown()
    for (ids_a, lp_a), (ids_b, lp_b) in zip(base, got):
        assert ids_a == ids_b
        for (a, ta), (b, tb) in zip(lp_a, lp_b):
            assert abs(a - b) < 1e-3
            assert [i for i, _ in ta] == [i for i, _ in tb]


def test_logprobs_at_temperature_and_cut_by_stop(plain):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=0)
    (ids, lps), = _logprobs(plain, params)[:1]
    assert len(lps) == len(ids) and all(top == [] and lp <= 0 for lp, top in lps)
    text = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    cut = SamplingParams(temperature=0, max_tokens=12, logprobs=1, stop=[text[6:9]])
    seq = plain.engine.add_request(plain.tokenizer.encode(PROMPTS[0]), cut)
    while not seq.finished:
        plain.engine.step()
    assert seq.finish_reason == "stop" and len(seq.logprobs) == len(seq.output_ids) < 12


def test_no_logprobs_unless_asked(plain):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(TypeError, match="logprobs"):
        SamplingParams(logprobs=1.5)
    seq = plain.engine.add_request(plain.tokenizer.encode("Hi"), SamplingParams(max_tokens=2))
    while not seq.finished:
        plain.engine.step()
    assert seq.logprobs is None


def test_top_alternatives_order_ties_by_token_id():
    """Equal log-probabilities come in token id order, the first as greedy decoding's argmax: ``topk`` alone
    may name another token first (it did, on the default model with 8-bit activations)."""
    lp = torch.full((1000,), -20.0)
    lp[[700, 12, 400]] = -0.5
    lp[[900, 3]] = -2.0
    top = top_alternatives(lp, 4)
    assert [t for t, _ in top] == [12, 400, 700, 3] and int(lp.argmax()) == top[0][0]
    assert [v for _, v in top] == [-0.5, -0.5, -0.5, -2.0]
    assert top_alternatives(lp, 1) == [(12, -0.5)]
