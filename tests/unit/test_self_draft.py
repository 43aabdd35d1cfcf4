"""Method ``target`` (the target as its own drafter): every greedy draft accepted, output identical to
plain decoding, and the distribution of plain sampling at temperature > 0."""

import pytest

from specserve import LLM, SamplingParams
from specserve.spec_decode import PROPOSERS
from specserve.spec_decode.options import parse_options
from specserve.spec_decode.self_draft import SelfDraftProposer
from tests.unit.test_spec_engine import assert_same_distribution, sample_prefixes

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_registered_with_typed_options():
    assert PROPOSERS["target"] is SelfDraftProposer
    assert parse_options(SelfDraftProposer.Options, {}, "target").num_speculative_tokens == 7
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse_options(SelfDraftProposer.Options, {"num_speculative_tokens": 0}, "target")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_every_draft_accepted(tiny_llama, quantization):
    kw = dict(model=str(tiny_llama), dtype="auto" if quantization else "float32", quantization=quantization,
              max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(**kw).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(**kw, speculative_config={"method": "target", "num_speculative_tokens": 4})
    spec = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    m = llm.get_metrics()
    assert m["acceptance_rate_per_position"] == [1.0] * 4
    assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
    assert not any(m["first_rejected_per_position"])
    # 23 tokens after the prefill: 4 steps of 5, then the last 3 tokens as room allows (2 drafts + 1)
    assert m["mean_acceptance_length"] == pytest.approx(23 / 5)


def test_distribution_matches_plain_sampling(small_vocab_model):
    kw = dict(model=str(small_vocab_model), dtype="float32", max_num_seqs=64, sampling_mode="rejection")
    plain = LLM(**kw)
    spec = LLM(**kw, speculative_config={"method": "target", "num_speculative_tokens": 3})
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    m = spec.get_metrics()
    assert m["num_accepted_tokens"] > 500 and m["num_accepted_tokens"] < m["num_draft_tokens"]
    assert_same_distribution(a, b)
