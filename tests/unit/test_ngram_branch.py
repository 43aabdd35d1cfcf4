"""``ngram_branch``: the n-gram (prompt lookup) continuation of the sequence as one more branch of every
draft of another drafter; verification stays lossless whichever branch wins."""

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.llm_engine import split_ngram_branch
from specserve.spec_decode.ngram import add_branch

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


def test_split_ngram_branch_takes_the_engine_option_out():
    spec = SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 5, "medusa_tree": "auto"})
    own, k = split_ngram_branch(spec)
    assert k == 5 and own.method == "medusa" and own.options == {"medusa_tree": "auto"}
    assert spec.options["ngram_branch"] == 5  # the caller's config is not changed
    assert split_ngram_branch(None) == (None, 0)
    plain = SpeculativeConfig.from_dict({"method": "medusa"})
    assert split_ngram_branch(plain) == (plain, 0)
    for bad in (True, -1, 33, "5", 2.0):
        with pytest.raises(ValueError, match="ngram_branch must be an int"):
            split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": bad}))
    with pytest.raises(ValueError, match="already drafts"):
        split_ngram_branch(SpeculativeConfig.from_dict({"method": "ngram", "ngram_branch": 3}))


REPETITIVE = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 8, 7, 9, 8, 7, 9], [20, 21, 22, 23, 24, 25]]


def _drafter(kind, model_dir, tmp_path):
    if kind.startswith("medusa"):
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], shared=False, scale=1.0)
        spec = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3}
        return {**spec, "medusa_tree": 8, "medusa_topk": 3} if kind == "medusa-tree" else spec
    drafter = write_random_drafter(tmp_path / "d", model_dir, scale=0.6)
    return {"method": "dspark", "model": str(drafter), **({"dspark_tree": 8} if kind == "dspark-tree" else {})}


@pytest.mark.parametrize("kind", ["medusa", "medusa-tree", "dspark", "dspark-tree"])
def test_greedy_identical_to_plain_and_the_branch_wins_steps(tiny_llama, tmp_path, kind):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(REPETITIVE, params, use_tqdm=False)]
    spec = _drafter(kind, tiny_llama, tmp_path)
    without = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec)
    with_branch = LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, "ngram_branch": 5})
    for llm in (without, with_branch):
        assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE, params, use_tqdm=False)] == plain
    st = with_branch.engine.stats
    assert st["ngram_branch_tokens"] > 0 and st["ngram_branch_wins"] > 0, st
    assert without.engine.stats["ngram_branch_tokens"] == 0
    # a tiny random model repeats itself: the n-gram branch adds accepted tokens to random drafters'
    assert with_branch.get_metrics()["mean_acceptance_length"] > without.get_metrics()["mean_acceptance_length"]


@pytest.mark.parametrize("kind", ["medusa", "dspark-tree"])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, kind):
    plain = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    spec = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64,
               speculative_config={**_drafter(kind, small_vocab_model, tmp_path), "ngram_branch": 4})
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    st = spec.engine.stats
    assert st["ngram_branch_tokens"] > 100 and st["ngram_branch_wins"] > 20, st  # the branch really played
    assert_same_distribution(a, b)
