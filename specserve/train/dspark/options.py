"""The options of a DSpark / DFlash training run (``specserve train dspark``) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.spec_decode.dspark_model import MARKOV_HEAD_TYPES
from specserve.train.common import FEATURE_DTYPES, check_distill_temperatures, check_num_prompts, eval_prompt_count
from specserve.train.dspark.features import DEFAULT_NUM_TARGET_LAYERS, parse_layer_ids


@dataclass
class DSparkTrainArgs:
    out: str
    model: str | None = None
    num_layers: int = 1  # draft decoder layers
    block_size: int = 7  # gamma: anchor + gamma-1 masks -> gamma drafts
    markov_rank: int = 64  # 0 = a DFlash baseline (no Markov head)
    markov_head_type: str = "vanilla"
    target_layer_ids: str | list[int] = "auto"
    num_target_layers: int = DEFAULT_NUM_TARGET_LAYERS  # how many layers "auto" picks
    mask_token_id: int | None = None  # default: vocab_size - 1
    # 0 = the target's whole vocabulary; else the most frequent response tokens. With ``init_from``: grow the
    # loaded drafter's (pruned) draft vocabulary to this size (0: keep it)
    draft_vocab_size: int = 0
    anchors_per_seq: int = 16
    prompts_file: str | list | None = None  # sources (common.prompt_sources); None: chitchat
    num_prompts: int | tuple[int, ...] = 400  # training prompts of each source, or one count per source
    num_eval_prompts: int | None = None  # default: max(8, the smallest num_prompts // 10)
    max_tokens: int = 128
    temperature: float = 0.0  # self-distillation sampling temperature (0 = greedy)
    # one more response per training prompt for each, sampled at that temperature (> 0)
    extra_temperatures: tuple[float, ...] = ()
    epochs: int = 2
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.0
    batch_size: int = 8  # sequences per optimizer step (each with anchors_per_seq blocks)
    loss_decay: float = 4.0  # w_k = exp(-(k-1)/loss_decay)
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    grad_clip: float = 1.0
    seed: int = 0  # the prompts' held-out split and the self-distillation's sampling
    # the training loop's randomness (random initial weights, the order of the sequences, the anchors);
    # None: ``seed``. Another value lets a continued run (``init_from``) draw new anchors over the same data
    train_seed: int | None = None
    threads: int | None = None
    cache_dir: str | None = None
    gen_batch_size: int = 16
    gen_dtype: str = "auto"  # dtype of the target while it writes the responses
    feature_dtype: str = "float32"  # dtype of the target forward that computes the features
    train_dtype: str = "float32"  # float32 | bfloat16 (mixed precision: autocast, float32 master weights)
    chat: bool = True
    progress: bool = True
    eval_only: bool = False  # evaluate the drafter already at ``out`` (no training); rewrite its README
    # start from the drafter at this path (any format ``load_dspark_checkpoint`` reads) instead of random
    # weights: its config decides the shape, layers, mask token and draft vocabulary, and the architecture
    # fields above are ignored
    init_from: str | None = None
    # with ``init_from``: this many more decoder layers after the loaded ones, their output projections
    # zero (the grown drafter starts as the loaded one), then all trained
    add_layers: int = 0
    # the training loop's state is saved in the cache every this many minutes (0: never), and the same run
    # started again continues from it (``resume``), ending with the weights of an uninterrupted run
    save_every_min: float = 10.0
    resume: bool = True

    def validate(self) -> None:
        for name in ("num_layers", "block_size", "anchors_per_seq", "max_tokens", "epochs",
                     "batch_size", "gen_batch_size", "num_target_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = DFlash), got {self.markov_rank}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0 (0 = the target's vocabulary), "
                             f"got {self.draft_vocab_size}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, "
                             f"got {self.markov_head_type!r}")
        check_num_prompts(self)
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.warmup < 1):
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        check_distill_temperatures(self)
        if not (self.loss_decay > 0):
            raise ValueError(f"loss_decay must be > 0, got {self.loss_decay}")
        for name in ("feature_dtype", "train_dtype"):
            if getattr(self, name) not in FEATURE_DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(FEATURE_DTYPES)}, got {getattr(self, name)!r}")
        if isinstance(self.target_layer_ids, str) and self.target_layer_ids.strip().lower() != "auto":
            parse_layer_ids(self.target_layer_ids)
        if not (self.save_every_min >= 0):
            raise ValueError(f"save_every_min must be >= 0 (0: never), got {self.save_every_min}")
        if self.init_from is not None and self.eval_only:
            raise ValueError("init_from trains a drafter further; eval_only trains nothing: pass one of them")
        if self.add_layers < 0:
            raise ValueError(f"add_layers must be >= 0, got {self.add_layers}")
        if self.add_layers and self.init_from is None:
            raise ValueError("add_layers grows the drafter of init_from: pass init_from too")

    @property
    def eval_prompts(self) -> int:
        return eval_prompt_count(self)
