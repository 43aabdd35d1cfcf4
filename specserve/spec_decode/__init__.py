"""Drafters behind one interface, found by name in a registry (the engine never names one)."""

from __future__ import annotations

import dataclasses

from specserve.spec_decode.defaults import with_defaults
from specserve.spec_decode.dspark import DFlashProposer, DSparkProposer
from specserve.spec_decode.medusa import MedusaProposer
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.ngram.branches import NgramBranches, split_ngram_branch
from specserve.spec_decode.options import parse_options
from specserve.spec_decode.proposer import NoProposer, Proposal, ProposeInputs, Proposer, TreeDraft
from specserve.spec_decode.self_draft import SelfDraftProposer

PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "medusa": MedusaProposer,
                                         "dspark": DSparkProposer, "dflash": DFlashProposer,
                                         "target": SelfDraftProposer}


def build_proposer(spec) -> Proposer:
    """``spec``: a ``SpeculativeConfig`` or None, completed with its method's defaults
    (``defaults.with_defaults``). N-gram branch keys wrap the drafter in ``NgramBranches``."""
    if spec is None:
        return NoProposer()
    spec = dataclasses.replace(spec, options=with_defaults(spec.method, spec.options))
    spec, branch_opts = split_ngram_branch(spec)
    if spec.method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {spec.method!r}; known: {', '.join(sorted(PROPOSERS))}")
    cls = PROPOSERS[spec.method]
    proposer = cls(parse_options(cls.Options, spec.proposer_kwargs(), spec.method))
    return NgramBranches(proposer, branch_opts) if branch_opts.ngram_branch else proposer


__all__ = ["PROPOSERS", "build_proposer", "NoProposer", "Proposal", "Proposer", "ProposeInputs", "TreeDraft"]
