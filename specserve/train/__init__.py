"""Training of draft models on the target's own outputs (self-distillation).

- ``specserve.train.data``: prompts (chitchat-dataset or a file), a deterministic held-out split, and
  ``self_distill`` (the target writes the responses; cached).
- ``specserve.train.medusa``: Medusa-1 heads on the frozen target (``specserve train medusa``).
"""

from specserve.train.data import load_prompts, self_distill

__all__ = ["load_prompts", "self_distill"]
