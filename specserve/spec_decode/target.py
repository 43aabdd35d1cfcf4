"""What a drafter sees of the target model: the small protocol the engine's runner implements
(``engine.model_runner.DraftTargetView``), so that drafters never reach into the runner or the model."""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import TPGroup


class DraftTarget(Protocol):
    """The target of ``Proposer.load_model``. ``packed``: its linears are oneDNN-packed (a drafter packs
    its own alike); ``quantization``: its weight quantization or None; ``max_num_seqs``: the largest
    batch a drafter must profile."""

    config: ModelConfig
    dtype: torch.dtype
    device: str
    tp: TPGroup
    packed: bool
    quantization: str | None
    max_num_seqs: int

    @property
    def embed_tokens(self) -> torch.nn.Module:
        """The token embedding (sharded under tensor parallelism)."""

    @property
    def lm_head(self) -> torch.nn.Module:
        """The LM head (``layers.embed_head.ParallelLMHead``)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of final normed hidden states."""

    def full_lm_head_weight(self) -> torch.Tensor:
        """The unsharded LM head weight (float), for heads replicated on every rank."""

    def full_embedding_weight(self) -> torch.Tensor:
        """The unsharded token embedding (float), for drafters replicated on every rank."""

    def step_costs(self, sizes: list[int], reps: int = 3) -> dict[int, float]:
        """Seconds of one target forward appending n tokens, for each n of ``sizes``, measured now."""

    def attach(self, name: str, factory, *args, **kwargs) -> None:
        """Build ``factory(runner, *args, **kwargs)`` on every rank as helper ``name``."""

    def helper(self, name: str):
        """The driver rank's helper ``name``."""

    def call_helper(self, name: str, method: str, *args, **kwargs):
        """Run ``method`` of helper ``name`` on every rank; the driver's result."""
