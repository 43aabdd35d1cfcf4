"""Prompts by category (train/categories.py), the bench's per-category figures and the oracle n-gram row."""

import gzip
import json

import pytest

from specserve.bench import categories as bench_categories
from specserve.bench.categories import category_figures, category_prompts, format_category_table
from specserve.bench.harness import MethodResult
from specserve.bench.oracle import NgramOracleMethod, replay_ngram
from specserve.spec_decode.metrics import SpecMetrics
from specserve.spec_decode.ngram.config import NgramOptions
from specserve.train import categories as cats
from specserve.train.data import DataError, is_heldout
from specserve.train.instructions import TEMPLATES_ACTIVITY, TEMPLATES_TOPIC


def test_every_instruction_template_has_a_category():
    assert set(TEMPLATES_TOPIC) | set(TEMPLATES_ACTIVITY) == set(cats.TEMPLATE_CATEGORY)
    assert set(cats.TEMPLATE_CATEGORY.values()) <= set(cats.CATEGORIES)


@pytest.mark.parametrize("category", cats.CATEGORIES)
def test_template_splits_non_empty_disjoint_deterministic(category):
    only = ("templates",)
    held = cats.load_category_prompts(category, "heldout", sources=only)
    train = cats.load_category_prompts(category, "train", sources=only)
    assert len(held) >= 6 and len(train) >= 5 * len(held)
    assert not set(held) & set(train)
    assert all(is_heldout(p) for p in held) and not any(is_heldout(p) for p in train)
    assert held == cats.load_category_prompts(category, "heldout", sources=only)  # deterministic
    other = cats.load_category_prompts(category, "heldout", seed=1, sources=only)
    assert sorted(other) == sorted(held) and other != held  # the seed orders, never selects
    assert cats.load_category_prompts(category, "heldout", n=3, sources=only) == held[:3]


def test_sharegpt_rules():
    assert cats.classify("I want you to act as a Linux terminal.") == "roleplay"
    assert cats.classify("Write a Python script that renames files") == "coding"
    assert cats.classify("What is 17 * 23?") == "math"
    assert cats.classify("Summarize the following article: ...") == "summary"
    assert cats.classify("Extract the company names from this list") == "extraction"
    assert cats.classify("Write a poem about the sea") == "writing"
    assert cats.classify("Should I learn the violin or the cello?") == "advice"
    assert cats.classify("Why is the sky blue?") == "qa"
    assert cats.classify("Hello there!") is None
    assert cats.classify("Describe your script-writing workflow in Javascript") == "coding"  # whole words


def test_bad_category_and_split_are_named():
    with pytest.raises(DataError, match="category must be one of"):
        cats.load_category_prompts("poetry")
    with pytest.raises(DataError, match="split must be"):
        cats.load_category_prompts("math", "test")
    with pytest.raises(DataError, match="sources must be"):
        cats.load_category_prompts("math", sources=("web",))
    with pytest.raises(DataError, match="categories are"):
        category_prompts("category:poetry")


def test_stored_heldout_prompts():
    """The stored set: every category, held out by its source's rule, read per category."""
    recs = cats.read_heldout_file(bench_categories.STORED_FILE)
    for c in cats.CATEGORIES:
        mine = [r for r in recs if r["category"] == c]
        assert len(mine) >= 6, c
        tpl = [r["prompt"] for r in mine if r["source"] == "templates"]
        assert tpl and all(is_heldout(p) for p in tpl)
        assert tpl == [p for p in cats.load_category_prompts(c, "heldout", sources=("templates",))
                       if p in set(tpl)]  # the loader's order
    both = category_prompts("category:math,coding", 2)
    assert [c for c, _ in both] == ["math", "math", "coding", "coding"]
    assert len(category_prompts("categories", 3)) == 3 * len(cats.CATEGORIES)
    if cats.sharegpt_available():  # the file is what the loader makes (with the ShareGPT package)
        n = cats.STORED_PER_CATEGORY
        assert [(r["category"], r["source"], r["prompt"]) for r in recs] == [
            (c, s, p) for c in cats.CATEGORIES for s, p in cats.category_records(c, "heldout", n)]


def test_heldout_file_round_trip_and_errors(tmp_path):
    f = tmp_path / "c.jsonl.gz"
    n = cats.write_heldout_file(f, 2, sources=("templates",))
    assert n == 2 * len(cats.CATEGORIES) and f.read_bytes() == (cats.write_heldout_file(f, 2, sources=("templates",))
                                                                 and f.read_bytes())
    assert [r["prompt"] for r in cats.read_heldout_file(f) if r["category"] == "qa"] == \
        cats.load_category_prompts("qa", n=2, sources=("templates",))
    f.write_bytes(gzip.compress(json.dumps({"category": "x", "prompt": "p"}).encode()))
    with pytest.raises(DataError, match="category"):
        cats.read_heldout_file(f)


def _metrics(steps):
    m = SpecMetrics()
    for drafted, accepted in steps:
        m.record(drafted, accepted)
    return m


def test_first_rejected_per_position_and_merge():
    m = _metrics([(3, 0), (3, 1), (3, 3), (2, 1), (0, 0)])
    assert m.first_rejected_per_position == [1, 2, 0]
    assert m.as_dict()["first_rejected_per_position"] == [1, 2, 0]
    total = _metrics([(1, 0)])
    total.merge(m)
    assert total.first_rejected_per_position == [2, 2, 0]
    assert (total.num_steps, total.num_drafts, total.num_accepted_tokens) == (6, 5, 5)
    assert total.drafted_per_position == [5, 4, 3]


def test_category_figures_aggregate_per_prompt():
    """Per category: the sum of its prompts' counters, tok/s over plain decoding's on those prompts,
    where drafts fail first and the draft vocabulary's coverage of plain decoding's tokens."""
    labels = ["a", "b", "a"]
    base = MethodResult([[1, 2, 3, 4], [5, 6], [7, 8]], 3.0, details={"walls": [1.0, 1.0, 1.0]})
    per = [_metrics([(2, 2), (2, 0)]), _metrics([(2, 1)]), _metrics([(1, 1)])]
    res = MethodResult([[1, 2, 3, 4], [5, 6], [7, 8]], 1.5,
                       details={"walls": [0.5, 0.5, 0.5], "metrics": per, "draft_vocabulary": {1, 2, 3, 7}})
    figs = category_figures(labels, res, base)
    assert list(figs) == ["a", "b"]
    a = figs["a"]
    assert a["prompts"] == 2 and a["tokens"] == 6
    assert a["mean_acceptance_length"] == pytest.approx((3 + 1 + 2) / 3)
    assert a["acceptance_rate_per_position"] == [pytest.approx(2 / 3, abs=1e-4), 0.5]
    assert a["first_rejected"] == [pytest.approx(round(1 / 3, 4)), 0.0]
    assert a["all_accepted"] == pytest.approx(round(2 / 3, 4))
    assert a["speedup_vs_none"] == pytest.approx(2.0)
    assert a["coverage"] == pytest.approx(4 / 6, abs=1e-4)
    assert figs["b"]["first_rejected"] == [0.0, 1.0] and figs["b"]["coverage"] == 0.0
    table = format_category_table([{"method": "none", "categories": figs}, {"method": "x", "categories": figs}])
    assert table.count("\n") == 3 and "x" in table and "0.67" in table  # a header, a rule, one line per category


def test_oracle_replay_by_hand():
    opts = NgramOptions(num_speculative_tokens=3)
    prompt = [1, 2, 3, 9, 1, 2, 4]
    out = [1, 2, 3, 9, 5, 6]  # the first token comes from the prefill
    # the context ends [.., 4, 1]: "1" offers [2, 4, 1] (most recent) and [2, 3, 9] (the answer's)
    oracle = replay_ngram(prompt, out, 64, opts)
    assert (oracle.num_steps, oracle.num_drafts, oracle.num_accepted_tokens) == (2, 1, 3)  # 5 has no match
    assert oracle.first_rejected_per_position == [0, 0, 0]
    recent = replay_ngram(prompt, out, 64, opts, "recent")  # [2, 4, 1]: 1 accepted; then [9, 1, 2]: 1
    assert (recent.num_steps, recent.num_accepted_tokens) == (3, 2)
    assert recent.first_rejected_per_position == [0, 2, 0]
    room = replay_ngram(prompt, out, 3, opts)  # max_tokens 3: one draft at most (room = 3 - 1 - 1)
    assert room.drafted_per_position == [1]


def test_oracle_row_options():
    assert NgramOracleMethod().opts.num_speculative_tokens == 7
    row = NgramOracleMethod("o", {"method": "ngram-oracle", "num_speculative_tokens": 3})
    assert row.opts.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="unknown option"):
        NgramOracleMethod("o", {"method": "ngram-oracle", "model": "x"})


def test_recent_replay_equals_the_ngram_drafter(tiny_llama):
    """The replay of the n-gram drafter's own choice over plain decoding's output gives the engine's
    figures for it: the oracle's figures are on the engine's scale."""
    from specserve import LLM, SamplingParams

    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 7, 8, 7], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "ngram_verify": "full"}
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec)
    llm.generate(prompts, params, use_tqdm=False)
    total = SpecMetrics()
    opts = NgramOptions(num_speculative_tokens=3)
    for p, o in zip(prompts, plain):
        total.merge(replay_ngram(p, list(o.outputs[0].token_ids), 24, opts, "recent"))
    assert total.num_draft_tokens > 0
    assert total.as_dict() == llm.get_metrics()


def test_bench_rows_by_category(tiny_llama, tmp_path, monkeypatch):
    """run_bench with --prompts categories: every row has its figures per category; the oracle n-gram
    row is computed (no speed, no identity) and bounds vLLM's n-gram row (the sequence's own n-grams);
    the target as its own drafter accepts every draft; the n-gram default is identical to plain."""
    from specserve.bench import harness

    f = tmp_path / "c.jsonl.gz"
    recs = [{"category": c, "source": "t", "prompt": " ".join(f"w{(i * 7 + j) % 50 + 1}" for j in range(6)) * 2}
            for i, c in enumerate(["math", "math", "qa"])]
    f.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in recs).encode()))
    monkeypatch.setattr(bench_categories, "STORED_FILE", f)
    rows = harness.run_bench(model=str(tiny_llama), methods="none,ngram,ngram-chain,ngram-oracle,target",
                             prompts_file="categories",
                             num_prompts=2, max_tokens=12, dtypes="float32", quantizations="none", threads=1)
    by = {r["method"]: r for r in rows}
    assert by["none"]["num_prompts"] == 3 and list(by["none"]["categories"]) == ["math", "qa"]
    oracle = by["ngram-oracle"]
    assert oracle["tokens_per_s"] is None and oracle["identical_to_none"] is None and oracle["simulated"]
    for cat in ("math", "qa"):
        assert (oracle["categories"][cat]["mean_acceptance_length"]
                >= by["ngram-chain"]["categories"][cat]["mean_acceptance_length"])
        t = by["target"]["categories"][cat]
        assert set(t["acceptance_rate_per_position"]) == {1.0} and t["all_accepted"] == 1.0
        assert t["speedup_vs_none"] > 0
    assert by["target"]["identical_to_none"] is True and by["ngram"]["identical_to_none"] is True
    table = harness.format_table(rows)
    assert "ngram-oracle" in table and format_category_table(rows).count("target") == 2


def test_interleaved_chats_compares_each_engine_with_its_reference():
    """Every engine answers every call (the order reversed every other call); ``same`` counts the calls
    whose answers equal the engine's reference's (default: the first engine)."""
    from types import SimpleNamespace

    order = []

    class Fake:
        def __init__(self, name, ids):
            self.name, self.ids = name, ids

        def chat(self, chats, params, use_tqdm=False):
            order.append(self.name)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.ids)]) for _ in chats]

    engines = {"a": Fake("a", [1, 2]), "b": Fake("b", [1, 3]), "c": Fake("c", [1, 3])}
    prompts = [("qa", "p1"), ("qa", "p2"), ("math", "p3")]
    args = SimpleNamespace(max_tokens=4)
    _, wall, tokens, same = bench_categories.interleaved_chats(engines, args, prompts, references={"c": "b"})
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert (same["a"], same["b"], same["c"]) == (3, 0, 3) and tokens["b"] == 6 and tokens[("math", "c")] == 2
