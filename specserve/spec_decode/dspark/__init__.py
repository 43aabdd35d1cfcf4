"""DSpark and DFlash: a small block drafter reading the target's hidden states, drafting a whole block
in one forward (DFlash), refined by a Markov head and weighed by a confidence head (DSpark)."""

from specserve.spec_decode.dspark.proposer import DFlashProposer, DSparkProposer

__all__ = ["DFlashProposer", "DSparkProposer"]
