"""``ngram_datastore``: continuations of the sequence's last tokens from a datastore of answers
(``spec_decode.ngram.datastore``), offered as n-gram drafts with their votes; lossless whatever the
datastore holds."""

import json

import pytest

from specserve import LLM, SamplingParams
from specserve.bench.categories import STORED_FILE
from specserve.config import SpeculativeConfig
from specserve.models.loader import resolve_model_dir
from specserve.spec_decode.defaults import resolve
from specserve.spec_decode.ngram.branches import BranchAcceptance, split_ngram_branch, store_key
from specserve.spec_decode.ngram.datastore import (DATASTORE_DIR, PROMPT_TAIL, DatastoreError, NgramDatastore,
                                                   open_datastore, record_digest, shipped_datastore)
from specserve.tokenizer import Tokenizer
from specserve.train.categories import read_heldout_file
from specserve.train.data import prompt_token_ids
from specserve.train.instructions import load_instruction_prompts
from specserve.train.store import DistillStore, _key, record_prompt, target_fingerprint

from test_ngram_branch import POOLED, REPETITIVE, _drafter, _verify_all
from test_spec_engine import PROMPT, assert_same_distribution, sample_prefixes


def test_continuations_follow_the_longest_match_with_its_votes():
    seqs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 7], [8, 3, 4, 5, 6, 1], [2, 3, 4, 9]]
    ds = NgramDatastore(seqs, n_min=1, n_max=8)
    # "2 3 4" occurs 3 times: 5 (twice), 9 (once); after "2 3 4 5" the two sequences split 6 / 7
    n, found = ds.continuations([0, 2, 3, 4], 4, 3)
    assert n == 3 and found == [([5, 6], [(2, 3), (1, 2)]), ([9], [(1, 3)])]
    # the longest suffix that occurs decides: "3 4 5" (3 times), not "4 5" (the same 3) nor a shorter one;
    # after its 6, one sequence ends where the other goes on: a tie, taken by the end
    n, found = ds.continuations([7, 3, 4, 5], 3, 1)
    assert n == 3 and found == [([6], [(2, 3)])]
    # "4 5 6" ends one sequence: that occurrence offers nothing but counts against the other's 1
    assert ds.continuations([4, 5, 6], 4, 2) == (3, [([1], [(1, 2)])])
    # "2 3 4 9", "3 4 9" and "4 9" only end a sequence: the 9 that starts one is matched
    assert ds.continuations([2, 3, 4, 9], 2, 2) == (1, [([2, 3], [(1, 2), (1, 1)])])
    assert ds.continuations([5, 7], 2, 2) == (0, [])  # "5 7" and "7" only end one
    assert ds.continuations([40, 41], 3, 2) == (0, [])
    assert ds.continuations([2, 3], 0, 2) == (0, []) and ds.continuations([2, 3], 3, 0) == (0, [])
    # eight tokens matched (both packed words), and a match across the words' boundary
    long = list(range(10, 22))
    ds = NgramDatastore([long, [5] + long[:6] + [99]], n_min=2, n_max=8)
    assert ds.continuations([0] + long[:8], 3, 1) == (8, [([18, 19, 20], [(1, 1), (1, 1), (1, 1)])])
    assert ds.continuations([0] + long[:6], 2, 2) == (6, [([16, 17], [(1, 2), (1, 1)]), ([99], [(1, 2)])])


def test_continuations_read_at_most_max_rows_occurrences():
    seqs = [[1, 2, t] for t in [7] * 30 + [8] * 10]
    ds = NgramDatastore(seqs, n_min=1, max_rows=8)
    n, found = ds.continuations([1, 2], 1, 2)
    assert n == 2 and sum(v[0][0] for _, v in found) == 8 and found[0][0] == [7]
    with pytest.raises(ValueError, match="n_max"):
        NgramDatastore(seqs, n_min=3, n_max=2)
    with pytest.raises(ValueError, match="token ids must lie"):
        NgramDatastore([[1, -2]])
    assert NgramDatastore(seqs, n_max=12).n_max == 8  # two words of four 16-bit tokens
    # a vocabulary past 16 bits: 17-bit tokens, three a word, matches of up to 6
    big = NgramDatastore([[70_000, 1, 2, 3, 4, 5, 6, 70_001], [9, 1, 2, 3, 4, 5, 6, 8]], n_min=1)
    assert (big.bits, big.n_max) == (17, 6)
    assert big.continuations([70_000, 1, 2, 3, 4, 5, 6], 2, 2) == (6, [([70_001], [(1, 2)]), ([8], [(1, 2)])])
    assert big.continuations([0, 70_000], 2, 1) == (1, [([1, 2], [(1, 1), (1, 1)])])
    assert big.continuations([1, 2, 3, 4, 5, 6, 70_002], 2, 1) == (0, [])  # an id it does not hold


def _write_store(path, answers: dict[tuple, list[int]]) -> None:
    DistillStore(path)._append({"note": "test"}, [(list(p), -1, list(a)) for p, a in answers.items()])


def test_a_store_directory_and_a_description_that_leaves_records_out(tmp_path):
    _write_store(tmp_path / "s", {(1, 2, 3, 4): [5, 6, 7], (8, 9, 3, 4): [5, 6, 1]})
    ds = NgramDatastore.load(tmp_path / "s", n_min=1)
    assert len(ds) == 2 and ds.num_tokens == 2 * (PROMPT_TAIL + 3)  # the prompt's tail before each answer
    # "3 4 5 6" twice, then 1 or 7: a tie takes the first in the sorted windows, half the votes
    assert ds.continuations([3, 4, 5], 2, 2) == (3, [([6, 1], [(2, 2), (1, 2)])])
    desc = tmp_path / "d.json"
    left_out = record_digest(_key([1, 2, 3, 4], -1))
    desc.write_text(json.dumps({"store": str(tmp_path / "s"), "exclude": [left_out]}))
    one = NgramDatastore.load(desc, n_min=1)
    assert len(one) == 1 and one.continuations([3, 4, 5], 2, 2) == (3, [([6, 1], [(1, 1), (1, 1)])])


def test_bad_datastores_are_named_in_one_line(tmp_path, tiny_llama):
    for bad, why in ((tmp_path / "none", "no such file"), (tmp_path, "no store.json")):
        with pytest.raises(DatastoreError, match=f"ngram_datastore: .*{why}"):
            open_datastore(str(bad), tiny_llama, 100)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(DatastoreError, match="x.json: not a datastore description"):
        open_datastore(str(tmp_path / "x.json"), tiny_llama, 100)
    _write_store(tmp_path / "big", {(1, 2, 3): [500, 4]})
    with pytest.raises(DatastoreError, match="token id 500 is outside the target's vocabulary of 100"):
        open_datastore(str(tmp_path / "big"), tiny_llama, 100)
    with pytest.raises(DatastoreError, match="ngram_datastore: .*no such file"):  # and the LLM says so too
        LLM(model=str(tiny_llama), speculative_config={"method": "ngram", "ngram_datastore": str(tmp_path / "none")})
    assert open_datastore(None, tiny_llama, 100) is None
    assert open_datastore("auto", tiny_llama, 100) is None  # nothing shipped for a tiny random model


def test_options_and_defaults():
    assert resolve({"method": "ngram", "ngram_datastore": "auto"})["ngram_datastore"] == "auto"
    # the datastore key alone keeps the default branches of a tree drafter
    got = resolve({"method": "medusa", "ngram_datastore": "auto"})
    assert got["ngram_branch"] == 12 and got["ngram_pool"] is True and got["ngram_datastore"] == "auto"
    own, opts = split_ngram_branch(SpeculativeConfig.from_dict(got))
    assert opts.ngram_datastore == "auto" and "ngram_datastore" not in own.options
    for bad in (5, True):
        with pytest.raises(ValueError, match="ngram_datastore must be 'auto', a path or None"):
            split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 4,
                                                            "ngram_datastore": bad}))
    with pytest.raises(ValueError, match="need ngram_branch"):
        split_ngram_branch(SpeculativeConfig.from_dict({"method": "medusa", "ngram_branch": 0,
                                                        "ngram_datastore": "auto"}))


def test_votes_are_the_prior_the_acceptance_learns_from():
    acc = BranchAcceptance(3)
    key = ("greedy", *store_key(8, [(4, 4), (3, 4)]))
    assert key[1:] == ("store", 4, 3, 2)
    assert acc.draft(key, [5, 6], [0.8, 0.6]).scores == pytest.approx([0.8, 0.48])
    for _ in range(20):  # the first token keeps failing: evidence outweighs the votes
        acc.observe(key, [5, 6], [7])
    assert acc.draft(key, [5, 6], [0.8, 0.6]).scores[0] < 0.2


def test_the_shipped_datastore_holds_no_held_out_answer():
    """``"auto"`` for the default model: its own answers to training prompts only; every record of a
    prompt the bench holds out (categories, instructions) is left out."""
    model_dir = resolve_model_dir(None)
    path = shipped_datastore(target_fingerprint(model_dir))
    assert path is not None and path.parent == DATASTORE_DIR
    desc = json.loads(path.read_text())
    tok = Tokenizer.from_dir(model_dir)
    held = [r["prompt"] for r in read_heldout_file(STORED_FILE)] + load_instruction_prompts("heldout")
    held_keys = {_key(prompt_token_ids(tok, p), -1) for p in held}
    recs = DistillStore(path.parents[3] / desc["store"]).records()
    found = [k for k in recs if k in held_keys]
    assert len(found) >= 40  # the trainers' held-out answers are in the store ...
    assert {record_digest(k) for k in found} <= set(desc["exclude"])  # ... and none in the datastore
    ds = open_datastore("auto", model_dir, 49152)
    assert len(ds) == len(recs) - len(desc["exclude"]) > 10_000
    assert ds.num_tokens == sum(min(len(record_prompt(k)), PROMPT_TAIL) + len(v)
                                for k, v in recs.items() if record_digest(k) not in desc["exclude"])


def _plain(model_dir, prompts, params):
    return [o.outputs[0].token_ids for o in LLM(model=str(model_dir), dtype="float32").generate(
        prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["ngram", "medusa-dynamic"])
def test_greedy_identical_to_plain_and_the_datastore_adds_accepted_tokens(tiny_llama, tmp_path, kind):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[40 + i, 7, 3, 11 + i] for i in range(3)]
    plain = _plain(tiny_llama, prompts, params)
    _write_store(tmp_path / "s", {tuple(p): a for p, a in zip(prompts, plain)})  # the answers themselves
    spec = {"method": "ngram"} if kind == "ngram" else {**_drafter(kind, tiny_llama, tmp_path), **POOLED}
    taus = {}
    for store in (None, str(tmp_path / "s")):
        llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={**spec, "ngram_datastore": store})
        if kind == "ngram":
            llm.engine.proposer.verify_costs = {1: 1.0, 4096: 1.0}  # every offered token verified
        else:
            _verify_all(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
        source = llm.engine.proposer.source
        assert (source.datastore is not None) == (source.stored_offers > 10) == (store is not None)
        taus[store] = llm.get_metrics()["mean_acceptance_length"]
    assert taus[str(tmp_path / "s")] > taus[None] + 1.0, taus
    # a datastore of other answers changes what is drafted, never the output
    other = {tuple(p): list(reversed(a)) for p, a in zip(prompts, plain)}
    _write_store(tmp_path / "o", other)
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={**spec, "ngram_datastore": str(tmp_path / "o")})
    assert [o.outputs[0].token_ids for o in llm.generate(REPETITIVE + prompts, params, use_tqdm=False)] == \
        _plain(tiny_llama, REPETITIVE + prompts, params)


@pytest.mark.parametrize("kind", ["ngram", "medusa-dynamic"])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, kind):
    plain = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    answers = sample_prefixes(plain, 200, 50_000, k=12)  # the model's own samples as the datastore
    _write_store(tmp_path / "s", {(i % 16, i // 16 % 16, *PROMPT): list(a) for i, a in enumerate(answers)})
    spec = {"method": "ngram"} if kind == "ngram" else {**_drafter(kind, small_vocab_model, tmp_path), **POOLED}
    llm = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64,
              speculative_config={**spec, "ngram_pool": False, "ngram_datastore": str(tmp_path / "s")})
    if kind == "ngram":
        llm.engine.proposer.verify_costs = {1: 1.0, 4096: 1.0}
    else:
        _verify_all(llm)
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(llm, 2000, 100_000, k=5)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 500 and m["num_accepted_tokens"] > 100, m
    assert llm.engine.proposer.source.stored_offers > 1000  # the datastore played
    assert_same_distribution(a, b)
