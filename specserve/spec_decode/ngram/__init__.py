"""N-gram drafting: prompt lookup as a drafter of its own, and n-gram branches added to another
drafter's drafts."""

from specserve.spec_decode.ngram.proposer import NgramProposer

__all__ = ["NgramProposer"]
