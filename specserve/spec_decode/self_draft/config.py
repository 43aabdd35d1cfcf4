"""The ``speculative_config`` keys of method ``target`` (the target as its own drafter)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.options import option


@dataclass(frozen=True)
class SelfDraftOptions:
    num_speculative_tokens: int = option(7, "greedy tokens of the target's copy per step", lo=1, hi=32)
