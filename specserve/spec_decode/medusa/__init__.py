"""Medusa: extra decoding heads on the target's last hidden state, each guessing one token further
ahead; chains, static trees or cost-model trees of their top tokens."""

from specserve.spec_decode.medusa.proposer import MedusaProposer

__all__ = ["MedusaProposer"]
