"""The target as its own drafter: the ceiling of any drafter's acceptance, and a test of verification."""

from specserve.spec_decode.self_draft.proposer import SelfDraftProposer

__all__ = ["SelfDraftProposer"]
