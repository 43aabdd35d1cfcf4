"""Coupled sampling (``sample.coupled``): a seeded request's tokens are a function of its seed and the
target alone, the same as plain decoding's with any drafter, draft shape, cost-model choice and batch,
and an exact sample of the target's distribution."""

import json
from collections import Counter

import pytest

from specserve import LLM, SamplingParams
from specserve.sample.coupled import position_uniform

from test_dspark import write_random_drafter
from test_medusa import make_heads
from test_spec_engine import assert_same_distribution, sample_prefixes


def test_position_uniform_is_a_function_of_seed_and_position_alone():
    assert position_uniform(7, 123) == position_uniform(7, 123)
    values = [position_uniform(s, t) for s in range(40) for t in range(500)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert len(set(values)) == len(values)  # no two (seed, position) pairs share a draw
    bins = Counter(int(u * 20) for u in values)  # 20 equal bins, 1000 expected in each
    stat = sum((bins[i] - 1000) ** 2 / 1000 for i in range(20))
    assert stat < 43.8, stat  # chi-square, 19 degrees of freedom, p = 0.001
    # neighbouring seeds and positions are not correlated: pairs (u(s, t), u(s, t + 1)) fill a 5x5 grid
    pairs = Counter((int(position_uniform(s, t) * 5), int(position_uniform(s, t + 1) * 5))
                    for s in range(40) for t in range(500))
    stat = sum((pairs[(i, j)] - 800) ** 2 / 800 for i in range(5) for j in range(5))
    assert stat < 51.2, stat  # 24 degrees of freedom, p = 0.001


def test_coupled_plain_sampling_draws_the_target_distribution(small_vocab_model):
    """Plain decoding with position-keyed uniforms samples what the stream-sampled plain decoding does
    (temperature 1, whole 3-token prefixes and each position's marginal), and its samples depend on
    the seed: different seeds, different texts."""
    coupled = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    stream = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64, sampling_mode="rejection")
    a = sample_prefixes(coupled, 2000, 0, k=3)
    b = sample_prefixes(stream, 2000, 100_000, k=3)
    assert len(a) > 50
    assert_same_distribution(a, b)


def _specs(model_dir, tmp_path):
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], scale=1.0)
    drafter = write_random_drafter(tmp_path / "d", model_dir, scale=0.6)
    dflash = write_random_drafter(tmp_path / "f", model_dir, markov_rank=0, scale=0.6)
    pool = {"ngram_branch": 4, "ngram_candidates": 2, "ngram_pool": True}
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "medusa": {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3},
        "medusa-tree-auto": {"method": "medusa", "model": str(heads), "medusa_tree": 8, "medusa_verify": "auto"},
        "medusa-auto-pool": {"method": "medusa", "model": str(heads), "medusa_verify": "auto", **pool},
        "dspark": {"method": "dspark", "model": str(drafter)},
        "dspark-probabilistic": {"method": "dspark", "model": str(drafter), "draft_sample_method": "probabilistic"},
        "dspark-verify-auto": {"method": "dspark", "model": str(drafter), "dspark_verify": "auto"},
        "dspark-tree-auto-pool": {"method": "dspark", "model": str(drafter), "dspark_tree": "auto", **pool},
        "dflash-tree": {"method": "dflash", "model": str(dflash), "dspark_tree": 6},
    }


PARAMS = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5),
          dict(temperature=1.2, min_p=0.05), dict(temperature=0)]


def _requests(n=15):
    prompts = [[(3 * i + j) % 16 for j in range(2 + i % 5)] for i in range(n)]
    params = [SamplingParams(**PARAMS[i % len(PARAMS)], seed=1000 + i, max_tokens=24, ignore_eos=True)
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "medusa", "medusa-tree-auto", "medusa-auto-pool", "dspark",
                                    "dspark-probabilistic", "dspark-verify-auto", "dspark-tree-auto-pool",
                                    "dflash-tree"])
def test_seeded_tokens_are_plain_decodings_with_every_drafter(small_vocab_model, tmp_path, method):
    """Same seed, same tokens: every drafter, auto modes included (their timing-based choices change
    what is verified, never what is emitted), batched (15 requests of mixed sampling settings at once)
    and alone, equal plain decoding's tokens with those seeds; the drafts were really used."""
    spec_cfg = _specs(small_vocab_model, tmp_path)[method]
    prompts, params = _requests()
    plain = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=16, speculative_config=spec_cfg)
    batched = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    alone = [spec.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts[:5], params[:5])]
    assert batched == want
    assert alone == want[:5]
    m = spec.get_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0


def test_rejection_mode_is_the_stream_sampler(small_vocab_model):
    """``sampling_mode="rejection"`` keeps vLLM's semantics: a request's tokens come from its own
    random stream (not the position-keyed draws), reproducible for the same configuration."""
    prompts, params = _requests(10)
    coupled = LLM(model=str(small_vocab_model), dtype="float32").generate(prompts, params, use_tqdm=False)
    stream = LLM(model=str(small_vocab_model), dtype="float32", sampling_mode="rejection")
    a = stream.generate(prompts, params, use_tqdm=False)
    b = stream.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in coupled]
    with pytest.raises(ValueError, match="sampling_mode must be 'coupled' or 'rejection', got 'exact'"):
        LLM(model=str(small_vocab_model), sampling_mode="exact")


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["ngram", "medusa-tree-auto", "dspark-tree-auto-pool"])
def test_seeded_tokens_are_the_same_under_tensor_parallelism(tiny_llama, tmp_path, method):
    """Tensor parallelism (2 processes) with a drafter, auto modes included, gives the same seeded
    tokens as one process without one."""
    prompts = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=20, ignore_eos=True)
              for t, s in ((0.8, 1), (1.0, 2), (0.6, 3))]
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama), dtype="float32").generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2,
              speculative_config=_specs(tiny_llama, tmp_path)[method])
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
