"""The benchmark harness: method names, and interleaving the methods prompt by prompt."""

import pytest


def test_bench_sized_tree_rows():
    from specserve.bench.harness import BenchError, method_factory, parse_methods

    assert parse_methods("medusa-tree-64,none") == ["none", "medusa-tree-64"]
    row = method_factory("medusa-tree-64")()
    assert row.name == "medusa-tree-64"
    assert row.speculative_config == {"method": "medusa", "medusa_tree": 64}
    assert method_factory("dspark-tree-12")().speculative_config == {"method": "dspark", "dspark_tree": 12}
    assert method_factory("dflash-tree-3")().speculative_config == {"method": "dflash", "dspark_tree": 3}
    for bad in ("medusa-tree-0", "medusa-tree-", "medusa-tree-x", "medusa-tree-064", "ngram-tree-4"):
        with pytest.raises(BenchError, match=r"\{medusa,dspark,dflash\}-tree-N"):
            parse_methods(bad)


def test_bench_ngram_suffix_adds_the_branch_to_drafters_only():
    from specserve.bench.harness import BenchError, method_factory, parse_methods

    row = method_factory("medusa-tree-dynamic-ngram")()
    assert row.name == "medusa-tree-dynamic-ngram"
    assert row.speculative_config == {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto",
                                      "ngram_branch": 5}
    assert method_factory("dspark-tree-12-ngram")().speculative_config == {"method": "dspark", "dspark_tree": 12,
                                                                             "ngram_branch": 5}
    assert method_factory("dspark-auto-ngram")().speculative_config["dspark_verify"] == "auto"
    assert method_factory("medusa-ngram12")().speculative_config == {"method": "medusa", "ngram_branch": 12}
    pool = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
    assert method_factory("dspark-tree-pool")().speculative_config == {"method": "dspark", "dspark_tree": "auto", **pool}
    assert method_factory("medusa-pool8")().speculative_config == {"method": "medusa", **pool, "ngram_branch": 8}
    for bad in ("none-ngram", "hf-ngram", "ngram-ngram", "dspark-prob-ngram", "medusa-ngram-ngram", "-ngram",
                "medusa-ngram0", "medusa-ngram-5", "medusa-ngram5-ngram", "medusa-pool-ngram", "none-pool"):
        with pytest.raises(BenchError, match="unknown method"):
            parse_methods(bad)


def test_bench_draft_dtype_suffix_sets_the_block_drafters_dtype():
    from specserve.bench.harness import BenchError, method_factory, parse_methods

    assert method_factory("dspark-draft-float32")().speculative_config == {"method": "dspark",
                                                                           "draft_dtype": "float32"}
    pool = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
    assert method_factory("dspark-tree-pool-draft-float32")().speculative_config == {
        "method": "dspark", "dspark_tree": "auto", **pool, "draft_dtype": "float32"}
    assert method_factory("dflash-draft-bfloat16@prev")().speculative_config == {
        "method": "dflash", "draft_dtype": "bfloat16", "model": "prev"}
    for bad in ("medusa-draft-float32", "ngram-draft-float32", "none-draft-float32", "dspark-draft-int8",
                "dspark-draft-float32-draft-bfloat16", "-draft-float32"):
        with pytest.raises(BenchError, match="unknown method"):
            parse_methods(bad)


def test_bench_interleaves_methods_prompt_by_prompt():
    """All methods load first, then every prompt goes through every method (order rotating), and the
    results equal a one-method-after-the-other run; sessions are closed either way."""
    from specserve.bench.harness import BenchContext, MethodResult, Session, _run_methods, run_alone

    calls, closed = [], []

    class FakeSession(Session):
        def __init__(self, ctx, name):
            super().__init__(ctx)
            self.name = name
            calls.append(("start", name))

        def _generate(self, ids, n, i):
            calls.append((self.name, i))
            return [len(self.name), i]

        def close(self):
            closed.append(self.name)

    class Fake:
        def __init__(self, name):
            self.name = name

        def start(self, ctx):
            return FakeSession(ctx, self.name)

        def run(self, ctx):
            return run_alone(self, ctx)

    ctx = BenchContext(None, None, "float32", [[1], [2], [3], [4]], [], 8, 0.0, 0, 1)
    names = ["none", "a", "bb"]
    runners = {n: Fake(n) for n in names}
    got = _run_methods(runners, names, ctx, True, lambda s: None)
    assert calls[:3] == [("start", n) for n in names]
    assert calls[3:] == [("none", 0), ("a", 0), ("bb", 0), ("a", 1), ("bb", 1), ("none", 1),
                         ("bb", 2), ("none", 2), ("a", 2), ("none", 3), ("a", 3), ("bb", 3)]
    assert sorted(closed) == sorted(names)
    calls.clear()
    closed.clear()
    alone = _run_methods(runners, names, ctx, False, lambda s: None)
    assert [c for c in calls if c[0] != "start"] == [(n, i) for n in names for i in range(4)]
    assert sorted(closed) == sorted(names)
    for n in names:
        assert isinstance(got[n], MethodResult) and got[n].outputs == alone[n].outputs == [[len(n), i] for i in range(4)]


def test_bench_heldout_prompt_sets():
    """The bench's held-out prompt sets are the trainers' held-out splits, disjoint from what they train on."""
    from specserve.bench.harness import load_prompts
    from specserve.train.data import load_prompts as load_chitchat
    from specserve.train.instructions import load_instruction_prompts

    chat = load_prompts("chitchat-heldout")
    assert chat == load_chitchat("heldout") and not set(chat) & set(load_chitchat("train"))
    instr = load_prompts("instructions-heldout")
    assert instr == load_instruction_prompts("heldout") and len(instr) >= 20
    assert not set(instr) & set(load_instruction_prompts("train"))


def test_bench_drafter_checkpoint_suffix():
    """``METHOD@PATH``: a drafter method with the checkpoint at PATH, for drafter methods only."""
    from specserve.bench.harness import BenchError, method_factory, parse_methods

    assert parse_methods("dspark-tree-pool@ck/a,dspark") == ["none", "dspark-tree-pool@ck/a", "dspark"]
    row = method_factory("dspark-tree-pool@ck/a")()
    assert row.name == "dspark-tree-pool@ck/a"
    assert row.speculative_config == {"method": "dspark", "dspark_tree": "auto", "ngram_branch": 12,
                                      "ngram_candidates": 3, "ngram_pool": True, "model": "ck/a"}
    assert method_factory("medusa-tree-16@x@y")().speculative_config == {"method": "medusa", "medusa_tree": 16,
                                                                         "model": "x@y"}
    for bad in ("none@x", "hf@x", "ngram@x", "dspark@", "@x", "nothing@x"):
        with pytest.raises(BenchError, match="unknown method"):
            parse_methods(bad)
