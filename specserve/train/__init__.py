"""Training of draft models on the target's own outputs (self-distillation).

- ``specserve.train.data``: prompts (chitchat-dataset or a file), a deterministic held-out split, and
  ``self_distill`` (the target writes the responses; cached).
- ``specserve.train.options``: the options every trainer takes, each written once as a dataclass field
  from which the command-line flags are generated.
- ``specserve.train.common``: the machinery both trainers share (prompts, runs, target forwards, saved
  training state).
- ``specserve.train.medusa``: Medusa-1 heads on the frozen target (``specserve train medusa``).
- ``specserve.train.dspark``: DSpark / DFlash block drafters on the frozen target (``specserve train
  dspark``), a package with one module per concern.
"""

from specserve.train.data import load_prompts, self_distill

__all__ = ["load_prompts", "self_distill"]
