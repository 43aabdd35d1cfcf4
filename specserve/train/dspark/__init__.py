"""DSpark / DFlash block-drafter training on a frozen target (``specserve train dspark``).

A run, module by module:

1. ``options``: the run's options (``DSparkTrainArgs``).
2. Data: the Medusa trainer's (``specserve.train.common``): prompts with a held-out split, answered by the
   target itself (self-distillation, cached and shared with ``specserve train medusa``).
3. ``features``: one cache-free forward of the target over every sequence gives the outputs of its
   ``target_layer_ids`` layers (HF ``hidden_states[id + 1]``, concatenated in layer order: what the
   proposer feeds the drafter) and its final normed hidden state, cached on disk. Default layer ids:
   ``num_target_layers`` evenly spaced between layer 1 and L-3 (z-lab's rule), never the last layer.
4. ``loss``: blocks anchor-first (DSpark's layout): for a response position ``a`` the block input is
   ``[token a, MASK x (gamma-1)]`` at positions ``a ..`` with the target's frozen embedding, the context
   is the features of positions ``< a``, slot k (0-based) predicts the token at ``a+k+1``. All blocks of a
   batch run in one forward of the drafter's own ``DFlashDrafter.forward_anchored_blocks``. Per slot k
   (1-based) with weight ``w_k = exp(-(k-1)/4)``: ``0.1 CE + 0.9 TV(p_draft, p_target) + 1.0 BCE(confidence,
   c*)``, ``c* = 1 - TV`` (DSpark, Eq. 9-12); draft logits = the target's lm_head (or the drafter's own over a
   pruned draft vocabulary) on the slot state + the Markov bias, teacher-forced.
5. ``loop``: AdamW, linear warm-up + cosine, gradient clipping; optional bfloat16 autocast; its state saved
   in the cache and continued by the same run.
6. ``evaluate`` and ``calibration``: every held-out anchor, the acceptance estimates, and sequential
   temperature scaling of the confidence head (``confidence_temperatures``, one per slot).
7. ``checkpoint`` and ``report``: DeepSpec format (speculators format for a pruned draft vocabulary) with
   the ``training`` record, and a generated README.
8. ``drafter``: the drafter's config for a target, its initial weights, and a loaded one grown by
   layers or draft-vocabulary tokens; ``run`` ties the phases together.

The mask token defaults to the target's last id (``vocab_size - 1``): the drafter only sees its frozen
embedding, and a rarely used id keeps a mask apart from frequent anchors.
"""

from specserve.train.dspark.calibration import ece, fit_sts
from specserve.train.dspark.checkpoint import checkpoint_config, save_checkpoint
from specserve.train.dspark.drafter import (
                                            draft_vocab_ids,
                                            drafter_config,
                                            grow_draft_vocab,
                                            grow_drafter_,
                                            init_drafter_,
                                            set_draft_vocab_,
)
from specserve.train.dspark.evaluate import acceptance_summary, evaluate_drafter
from specserve.train.dspark.features import (
                                            cached_target_features,
                                            compute_target_features,
                                            default_target_layer_ids,
                                            parse_layer_ids,
                                            resolve_layer_ids,
                                            target_lse,
)
from specserve.train.dspark.loop import train_drafter
from specserve.train.dspark.loss import IGNORE, anchor_range, block_outputs, collate, slot_states, slot_weights
from specserve.train.dspark.options import DSparkTrainArgs
from specserve.train.dspark.run import train_dspark

__all__ = [
    "DSparkTrainArgs", "train_dspark", "IGNORE", "acceptance_summary", "anchor_range", "block_outputs",
    "cached_target_features", "checkpoint_config", "collate", "compute_target_features", "default_target_layer_ids",
    "draft_vocab_ids", "drafter_config", "ece", "evaluate_drafter", "fit_sts", "grow_draft_vocab", "grow_drafter_",
    "init_drafter_", "parse_layer_ids", "resolve_layer_ids", "save_checkpoint", "set_draft_vocab_", "slot_states",
    "slot_weights", "target_lse", "train_drafter",
]
