"""The options of a DSpark / DFlash training run (``specserve train dspark``): each written once, with
its help and command-line form (``specserve.train.options``), and their checks."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specserve.device import resolve_device
from specserve.spec_decode.dspark.config import MARKOV_HEAD_TYPES
from specserve.train.common import FEATURE_DTYPES
from specserve.train.dspark.features import DEFAULT_NUM_TARGET_LAYERS, parse_layer_ids
from specserve.train.options import TrainOptions, nonneg_int, option, positive_int


@dataclass(kw_only=True)
class DSparkTrainArgs(TrainOptions):
    """``shape=True``: the drafter's shape, which ``init_from`` takes from the loaded drafter instead."""

    train_dtype: str = option("float32", "float32, or bfloat16 mixed precision (autocast forward, float32 weights and "
                              "optimiser)", choices=FEATURE_DTYPES)
    num_layers: int = option(1, "draft decoder layers", type=positive_int, unset=True, shape=True)
    block_size: int = option(7, "gamma: the anchor + gamma-1 masks give gamma drafts", type=positive_int, unset=True,
                             shape=True)
    markov_rank: int = option(64, "rank of the Markov head (0 = a DFlash baseline without it)", type=nonneg_int,
                              unset=True, shape=True)
    markov_head_type: str = option("vanilla", "Markov head variant", choices=MARKOV_HEAD_TYPES, unset=True,
                                   shape=True)
    target_layer_ids: str | list[int] = option(
        "auto", "target layers whose outputs feed the drafter: 'auto' (--num-target-layers ids evenly spaced between "
        "1 and L-3; [0] for a 2-layer target) or a comma list", metavar="auto|IDS", unset=True, shape=True)
    num_target_layers: int = option(DEFAULT_NUM_TARGET_LAYERS, "how many layers 'auto' picks", type=positive_int,
                                    unset=True, shape=True)
    mask_token_id: int | None = option(None, "id of the mask token in the target vocabulary (default: the last id, "
                                       "vocab_size - 1)", type=nonneg_int, shape=True)
    # with ``init_from``, ``draft_vocab_size`` grows the loaded drafter's (pruned) draft vocabulary (0: keep it)
    anchors_per_seq: int = option(16, "random anchor positions (blocks) per sequence per epoch", type=positive_int)
    epochs: int = option(2, "passes over the sequences", type=positive_int)
    lr: float = option(6e-4, "AdamW peak learning rate", type=float)
    warmup: float = option(0.04, "linear warm-up, fraction of the steps", type=float)
    weight_decay: float = 0.0
    batch_size: int = option(8, "sequences per step, each with --anchors-per-seq blocks", type=positive_int)
    loss_decay: float = 4.0  # w_k = exp(-(k-1)/loss_decay)
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    grad_clip: float = 1.0
    train_seed: int | None = option(
        None, "seed of the training loop alone (random initial weights, order of the sequences, anchors) while --seed "
        "keeps the held-out split and the responses: e.g. a run continued with --init-from on the same data draws "
        "new anchors instead of the last run's (default: --seed)", type=int, metavar="N")
    init_from: str | None = option(
        None, "start from the drafter at DIR (DeepSpec, speculators or z-lab format) instead of random weights, e.g. "
        "to train the shipped one further or on your own prompts: DIR's config gives the shape, target layers, mask "
        "token and draft vocabulary (so none of --num-layers, --block-size, --markov-rank, --markov-head-type, "
        "--target-layer-ids, --num-target-layers, --mask-token-id; --draft-vocab-size N grows its pruned draft "
        "vocabulary to N: its tokens and the most frequent other ones of the new responses)", metavar="DIR")
    device: str = option("cpu", "where the target's features, the training and the held-out evaluation run: cpu or "
                         "cuda[:N] (a GPU runs the target dense, a GGUF's weights dequantized; the responses still "
                         "come from the CPU engine or --distill-store)", metavar="DEVICE")
    add_layers: int = option(0, "with --init-from: grow the drafter by N decoder layers after its own, their output "
                             "projections zero so it starts as the loaded drafter, then train them all",
                             type=nonneg_int, metavar="N")

    def validate(self) -> None:
        super().validate()
        for name in ("num_layers", "block_size", "anchors_per_seq", "num_target_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = DFlash), got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                             f"got {self.markov_head_type!r}")
        if not (self.loss_decay > 0):
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")
        if self.train_dtype not in FEATURE_DTYPES:
            raise ValueError(f"train_dtype must be one of {', '.join(FEATURE_DTYPES)}, got {self.train_dtype!r}")
        if isinstance(self.target_layer_ids, str) and self.target_layer_ids.strip().lower() != "auto":
            parse_layer_ids(self.target_layer_ids)
        if self.init_from is not None and self.eval_only:
            raise ValueError("init_from trains a drafter further; eval_only trains nothing: pass one of them")
        if self.device != "cpu":
            if not re.fullmatch(r"cuda(:\d+)?", str(self.device)):
                raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
            resolve_device(self.device)  # a clear error where torch sees no such GPU
        if self.add_layers < 0:
            raise ValueError(f"add_layers must be >= 0, got {self.add_layers}")
        if self.add_layers and self.init_from is None:
            raise ValueError("add_layers grows the drafter of init_from: pass init_from too")
