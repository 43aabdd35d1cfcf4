"""Typed drafter options: every method's ``speculative_config`` keys come from one dataclass, checked
by ``parse_options`` with one error naming the key."""

import dataclasses

import pytest

from specserve.spec_decode import PROPOSERS
from specserve.spec_decode.dspark.config import DSparkOptions
from specserve.spec_decode.medusa.config import MedusaOptions
from specserve.spec_decode.ngram.config import NgramBranchOptions, NgramOptions
from specserve.spec_decode.options import parse_options


def test_every_registered_drafter_declares_typed_options():
    for name, cls in PROPOSERS.items():
        assert dataclasses.is_dataclass(cls.Options), name
        for f in dataclasses.fields(cls.Options):
            assert f.metadata.get("help"), (name, f.name)  # every key says what it does
        assert parse_options(cls.Options, {}, name) == cls.Options()  # the defaults are valid


def test_values_are_checked_against_type_and_bounds():
    opts = parse_options(DSparkOptions, {"dspark_tree": "auto", "confidence_threshold": 1, "draft_gate": False},
                         "dspark")
    assert (opts.dspark_tree, opts.confidence_threshold, opts.draft_gate) == ("auto", 1, False)
    assert parse_options(MedusaOptions, {"medusa_tree": [[0], [0, 1]]}, "medusa").medusa_tree == [[0], [0, 1]]
    for cls, bad, match in [
        (DSparkOptions, {"dspark_tree": 0}, "dspark_tree must be None, 'auto' or a node count >= 1, got 0"),
        (DSparkOptions, {"dspark_tree": "big"}, "dspark_tree must be"),
        (DSparkOptions, {"dspark_tree": True}, "dspark_tree must be"),
        (DSparkOptions, {"confidence_threshold": 1.5}, r"confidence_threshold must be a number in 0.0..1.0"),
        (DSparkOptions, {"draft_gate": 1}, "draft_gate must be true or false, got 1"),
        (DSparkOptions, {"draft_dtype": "int8"}, "draft_dtype must be one of 'auto', 'float32'"),
        (DSparkOptions, {"num_speculative_tokens": 2.0}, "num_speculative_tokens must be an int in 1..32"),
        (MedusaOptions, {"medusa_topk": 65}, "medusa_topk must be an int in 1..64, got 65"),
        (MedusaOptions, {"medusa_tree": "big"}, "medusa_tree must be None, 'auto', a node count"),
        (NgramOptions, {"prompt_lookup_min": 0}, "prompt_lookup_min must be an int >= 1"),
        (NgramOptions, {"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "need 1 <= prompt_lookup_min"),
        (NgramBranchOptions, {"ngram_pool": True}, "need ngram_branch"),
        (MedusaOptions, {"bogus": 1, "medusa_topk": 3}, "unknown option\\(s\\) 'bogus'; it takes model, "),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_options(cls, bad, "m")


def test_cross_key_rules_live_with_the_options():
    with pytest.raises(ValueError, match="draft_sample_method='greedy'"):
        DSparkOptions(dspark_tree=4, draft_sample_method="probabilistic")
    with pytest.raises(ValueError, match="leave dspark_verify"):
        DSparkOptions(dspark_tree=4, dspark_verify="auto")
