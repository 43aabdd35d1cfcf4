"""Each method's default configuration (``spec_decode.defaults``): a bare method name runs the
documented best configuration, and the simpler variants stay reachable."""

from pathlib import Path

import pytest

import specserve

from specserve.config import SpeculativeConfig
from specserve.spec_decode import build_proposer
from specserve.spec_decode.defaults import resolve
from specserve.spec_decode.dspark import DSparkProposer
from specserve.spec_decode.medusa import MedusaProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.ngram.branches import NgramBranches

POOL = {"ngram_branch": 12, "ngram_candidates": 3, "ngram_pool": True}
NGRAM = {"ngram_verify": "auto", "ngram_candidates": 3, "ngram_pool": True}
CK = str(Path(specserve.__file__).parent / "checkpoints" / "dspark-smollm2-135m")


def build(config: dict):
    return build_proposer(SpeculativeConfig.from_dict(config))


@pytest.mark.parametrize("config, expected", [
    # the defaults, as README and docs/methods.md give them
    ({"method": "medusa"}, {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **POOL}),
    ({"method": "dspark"}, {"method": "dspark", "dspark_tree": "auto", **POOL}),
    ({"method": "dflash"}, {"method": "dflash", "dspark_tree": "auto", **POOL}),
    ({"method": "ngram"}, {"method": "ngram", **NGRAM}),
    ({"method": "target"}, {"method": "target"}),
    # vLLM's keys keep their meaning beside the defaults
    ({"method": "dspark", "num_speculative_tokens": 5, "model": CK},
     {"method": "dspark", "num_speculative_tokens": 5, "model": CK, "dspark_tree": "auto", **POOL}),
    # simple variants: a chain (no branches with it), every draft verified
    ({"method": "medusa", "medusa_tree": None, "medusa_verify": "full"},
     {"method": "medusa", "medusa_tree": None, "medusa_verify": "full"}),
    ({"method": "medusa", "medusa_tree": None}, {"method": "medusa", "medusa_tree": None, "medusa_verify": "auto"}),
    ({"method": "dspark", "dspark_tree": None}, {"method": "dspark", "dspark_tree": None}),
    ({"method": "ngram", "ngram_verify": "full"}, {"method": "ngram", "ngram_verify": "full"}),
    ({"method": "ngram", "num_speculative_tokens": 3, "ngram_pool": False},
     {"method": "ngram", "num_speculative_tokens": 3, **NGRAM, "ngram_pool": False}),
    # chain-only modes make the tree default step aside
    ({"method": "dspark", "dspark_verify": "auto"}, {"method": "dspark", "dspark_verify": "auto"}),
    ({"method": "dflash", "draft_sample_method": "probabilistic"},
     {"method": "dflash", "draft_sample_method": "probabilistic"}),
    # ... but their default values do not
    ({"method": "dspark", "dspark_verify": "full"}, {"method": "dspark", "dspark_verify": "full",
                                                     "dspark_tree": "auto", **POOL}),
    # any branch key replaces the default branches; a tree size of the user's keeps the branches
    ({"method": "dspark", "ngram_branch": 0}, {"method": "dspark", "ngram_branch": 0, "dspark_tree": "auto"}),
    ({"method": "medusa", "ngram_branch": 6}, {"method": "medusa", "ngram_branch": 6, "medusa_tree": "auto",
                                               "medusa_verify": "auto"}),
    ({"method": "dspark", "dspark_tree": 16}, {"method": "dspark", "dspark_tree": 16, **POOL}),
])
def test_defaults_resolve_to_the_documented_configuration(config, expected):
    assert resolve(config) == expected
    assert config == {k: v for k, v in config.items()}  # the caller's dict is not changed
    build(config)  # and every one is a valid configuration


def test_default_proposers_are_trees_with_pooled_branches():
    for method in ("dspark", "dflash"):
        p = build({"method": method})
        assert isinstance(p, NgramBranches) and isinstance(p.inner, DSparkProposer)
        assert p.inner.tree_size == "auto" and p.inner.verify_mode == "full"
        assert (p.opts.ngram_branch, p.opts.ngram_candidates, p.opts.ngram_pool) == (12, 3, True)
    p = build({"method": "medusa"})
    assert isinstance(p, NgramBranches) and isinstance(p.inner, MedusaProposer)
    assert (p.inner.tree_spec, p.inner.verify_mode, p.inner.acceptance) == ("auto", "auto", "exact")
    p = build({"method": "ngram"})  # n-gram drafting: no branches of its own, its candidates chosen alike
    assert isinstance(p, NgramProposer) and p.verify_mode == "auto"
    assert (p.num_speculative_tokens, p.source.limit, p.source.pool is not None) == (5, 3, True)


def test_simple_variants_stay_reachable():
    chain = build({"method": "medusa", "medusa_tree": None, "medusa_verify": "full"})
    assert isinstance(chain, MedusaProposer) and (chain.tree_spec, chain.verify_mode) == (None, "full")
    for cfg in ({"method": "dspark", "dspark_tree": None}, {"method": "dspark", "dspark_verify": "threshold"},
                {"method": "dflash", "dspark_tree": None, "draft_sample_method": "probabilistic"}):
        p = build(cfg)
        assert isinstance(p, DSparkProposer) and p.tree_size is None
    tree_alone = build({"method": "dspark", "ngram_branch": 0})
    assert isinstance(tree_alone, DSparkProposer) and tree_alone.tree_size == "auto"
    vllm = build({"method": "ngram", "ngram_verify": "full", "prompt_lookup_max": 3})
    assert isinstance(vllm, NgramProposer) and vllm.verify_mode == "full"
    assert (vllm.source.limit, vllm.source.pool, vllm.source.n_max) == (1, None, 3)
    with pytest.raises(ValueError, match="ngram_branch adds n-gram drafts"):
        build({"method": "ngram", "ngram_branch": 4})
    # a tree with a chain-only mode the user asked for both: still refused, naming the conflict
    with pytest.raises(ValueError, match="dspark_tree .*dspark_verify"):
        build({"method": "dspark", "dspark_tree": "auto", "dspark_verify": "auto"})


def test_bench_presets_name_what_they_change():
    """The bench's bare-name rows are the defaults; every other preset resolves to a distinct
    configuration (no preset silently equal to another through the defaults, but the spelled-out ones)."""
    from specserve.bench.harness import PRESETS

    resolved = {name: resolve(cfg) for name, cfg in PRESETS.items() if cfg is not None}
    assert resolved["medusa"] == resolved["medusa-tree-dynamic-pool"]
    assert resolved["dspark"] == resolved["dspark-tree-pool"] and resolved["dflash"] == resolved["dflash-tree-pool"]
    assert resolved["medusa-chain"] == {"method": "medusa", "medusa_tree": None, "medusa_verify": "full"}
    assert resolved["dspark-chain"] == {"method": "dspark", "dspark_tree": None}
    spelled_out = {"medusa-tree-dynamic-pool", "dspark-tree-pool", "dflash-tree-pool"}
    seen = {}
    for name, cfg in resolved.items():
        if name in spelled_out:
            continue
        key = repr(sorted(cfg.items(), key=str))
        assert key not in seen, f"presets {seen.get(key)} and {name} run the same configuration"
        seen[key] = name
