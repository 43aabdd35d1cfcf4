"""DSpark's and DFlash's configuration: the checkpoint's shape (``DSparkConfig``, with the state dict
it implies) and the ``speculative_config`` keys (``DSparkOptions``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from specserve.models.loader import CheckpointError
from specserve.spec_decode.options import option

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
VERIFY_MODES = ("full", "threshold", "auto")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class DSparkOptions:
    model: str | None = option(None, "the drafter's checkpoint (default: the one shipped for the default model)")
    num_speculative_tokens: int | None = option(None, "drafts per step (default: the drafter's block)", lo=1, hi=32)
    draft_sample_method: str = option("greedy", "'greedy' drafts, or 'probabilistic': sampled from the corrected "
                                      "distribution", choices=("greedy", "probabilistic"))
    dspark_verify: str = option("full", "'full': every draft verified; 'threshold': up to the first confidence "
                                "below confidence_threshold; 'auto': as many as the cost model finds worth",
                                choices=VERIFY_MODES)
    confidence_threshold: float = option(0.5, "dspark_verify='threshold': the confidence cut", lo=0.0, hi=1.0)
    markov_replicate: bool = option(True, "the Markov head replicated on every tensor-parallel rank (else sharded)")
    dspark_tree: int | str | None = option(None, "None: a chain; 'auto': trees sized per step by the cost model; "
                                           "N: trees of N nodes", choices=("auto",), lo=1,
                                           expect="None, 'auto' or a node count >= 1")
    dspark_tree_topk: int = option(4, "trees: candidate tokens per node", lo=1, hi=64)
    dspark_tree_beam: int = option(4, "trees: partial paths kept per depth", lo=1, hi=64)
    online_calibration: bool = option(True, "correct the predicted acceptance by what earlier steps accepted")
    draft_gate: bool = option(True, "'auto' modes: a request whose drafts do not pay sits drafting out a while")
    draft_dtype: str = option("auto", "the drafter's dtype ('auto': bfloat16 where it runs fast)", choices=DRAFT_DTYPES)
    draft_quantization: str = option("auto", "the drafter's weights ('auto': 8 bits beside a quantized target)",
                                     choices=DRAFT_QUANTIZATIONS)

    def __post_init__(self) -> None:
        if self.dspark_tree is None:
            return
        if self.draft_sample_method != "greedy":
            raise ValueError("dspark_tree drafts the top tokens of each node: use draft_sample_method='greedy' "
                             "(tree verification is lossless at any temperature)")
        if self.dspark_verify != "full":
            raise ValueError("dspark_tree chooses the verified nodes itself ('auto' or a size): leave "
                             f"dspark_verify at 'full', got {self.dspark_verify!r}")



@dataclass
class DSparkConfig:
    """A DFlash / DSpark drafter.

    hidden_size: must equal the target's (the drafter uses the target's embedding and lm_head).
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, num_layers, rms_norm_eps,
    rope_theta, rope_scaling, attention_bias: the draft decoder stack (Qwen3 style, per-head q/k norm).
    target_layer_ids: target decoder layers whose outputs (HF ``hidden_states[id + 1]``) feed ``fc``;
    each in ``[0, L-1)`` for an L-layer target (the last layer is forbidden).
    block_size: block inputs per step (anchor + block_size-1 masks), >= 1 (>= 2 when mask-only).
    mask_token_id: id of the mask token in the target vocabulary (required).
    sample_from_anchor: True = anchor-first (DSpark; block_size drafts, slot k predicts p+k+1);
    False = mask-only (DFlash; block_size-1 drafts, slot k predicts p+k).
    markov_rank: rank r of the Markov head, 0 = none (pure DFlash). markov_head_type: vanilla | gated
    | rnn. enable_confidence_head / confidence_head_with_markov: the confidence head and whether it
    also reads ``W1[x_{k-1}]`` (needs markov_rank > 0).
    vocab_size: the target's vocabulary. draft_vocab_size: <= vocab_size; smaller = a pruned draft
    vocabulary with its own lm_head and ``d2t`` offsets.
    source_fields: our field -> the checkpoint's field name, for error messages only.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int | None
    sample_from_anchor: bool
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    vocab_size: int = 0
    draft_vocab_size: int = 0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    source_format: str = ""
    source_fields: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.draft_vocab_size:
            self.draft_vocab_size = self.vocab_size
        self.target_layer_ids = [int(i) for i in (self.target_layer_ids or [])]

    # -- derived ------------------------------------------------------------------------------------
    @property
    def num_drafts(self) -> int:
        """Draft tokens one block forward yields: block_size (anchor-first) or block_size - 1."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        """Index of the block slot that gives the first draft (0 anchor-first, 1 mask-only)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_aux_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def pruned_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source_fields")
        return d

    # -- validation ---------------------------------------------------------------------------------
    def _name(self, f: str) -> str:
        src = self.source_fields.get(f)
        return f if not src or src == f else f"{f} (checkpoint field {src!r})"

    def _fail(self, f: str, msg: str):
        where = f"{self.source_format} drafter" if self.source_format else "drafter"
        raise CheckpointError(f"{where}: {self._name(f)} {msg}")

    def validate(self, target_cfg=None) -> None:
        """Check the drafter on its own and, with ``target_cfg`` (a ``ModelConfig``), against the
        target. Raises ``CheckpointError`` naming the offending field."""
        for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "num_layers", "vocab_size", "draft_vocab_size"):
            if int(getattr(self, f)) <= 0:
                self._fail(f, f"must be > 0, got {getattr(self, f)}")
        if self.num_attention_heads % self.num_key_value_heads:
            self._fail("num_key_value_heads", f"({self.num_key_value_heads}) must divide num_attention_heads "
                       f"({self.num_attention_heads})")
        if self.mask_token_id is None:
            self._fail("mask_token_id", "is missing: the drafter needs the id of its mask token")
        if not (0 <= int(self.mask_token_id) < self.vocab_size):
            self._fail("mask_token_id", f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        min_block = 1 if self.sample_from_anchor else 2
        if self.block_size < min_block:
            layout = "anchor-first" if self.sample_from_anchor else "mask-only"
            self._fail("block_size", f"must be >= {min_block} for the {layout} layout, got {self.block_size}")
        if not self.target_layer_ids:
            self._fail("target_layer_ids", "is empty: the drafter needs at least one target layer")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            self._fail("target_layer_ids", f"{self.target_layer_ids} has duplicates")
        if any(i < 0 for i in self.target_layer_ids):
            self._fail("target_layer_ids", f"{self.target_layer_ids} has a negative layer id")
        if self.markov_rank < 0:
            self._fail("markov_rank", f"must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            self._fail("markov_head_type", f"{self.markov_head_type!r} is not one of {', '.join(MARKOV_HEAD_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.has_markov:
            self._fail("confidence_head_with_markov", "is true but markov_rank is 0 (no Markov embedding to read)")
        if self.draft_vocab_size > self.vocab_size:
            self._fail("draft_vocab_size", f"({self.draft_vocab_size}) exceeds the target vocabulary "
                       f"vocab_size ({self.vocab_size})")
        if target_cfg is None:
            return
        if self.hidden_size != target_cfg.hidden_size:
            self._fail("hidden_size", f"is {self.hidden_size}, the target model's hidden_size is "
                       f"{target_cfg.hidden_size} (the drafter shares the target's embedding and lm_head)")
        if self.vocab_size != target_cfg.vocab_size:
            self._fail("vocab_size", f"is {self.vocab_size}, the target model's vocab_size is {target_cfg.vocab_size}")
        n = target_cfg.num_hidden_layers
        for i in self.target_layer_ids:
            if i >= n:
                self._fail("target_layer_ids", f"{self.target_layer_ids}: layer {i} does not exist in the target "
                           f"(num_hidden_layers {n}, ids 0..{n - 1})")
            if i == n - 1:
                self._fail("target_layer_ids", f"{self.target_layer_ids}: layer {i} is the target's last layer, "
                           "which is forbidden (its HF hidden state is post-norm)")


def expected_state_shapes(cfg: DSparkConfig) -> dict[str, tuple]:
    """Every tensor of the drafter (our names, as ``DFlashDrafter.load_state`` wants them) -> shape."""
    d, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out: dict[str, tuple] = {"fc.weight": (d, cfg.num_aux_layers * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (H * D, d)
        out[p + "self_attn.k_proj.weight"] = (Hkv * D, d)
        out[p + "self_attn.v_proj.weight"] = (Hkv * D, d)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (H * D,)
            out[p + "self_attn.k_proj.bias"] = (Hkv * D,)
            out[p + "self_attn.v_proj.bias"] = (Hkv * D,)
        out[p + "self_attn.o_proj.weight"] = (d, H * D)
        out[p + "self_attn.q_norm.weight"] = (D,)
        out[p + "self_attn.k_norm.weight"] = (D,)
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, d)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, d)
        out[p + "mlp.down_proj.weight"] = (d, cfg.intermediate_size)
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
    if cfg.pruned_vocab:
        out["lm_head.weight"] = (cfg.draft_vocab_size, d)
        out["d2t"] = (cfg.draft_vocab_size,)
    r = cfg.markov_rank
    if r > 0:
        out["markov_head.markov_w1.weight"] = (cfg.vocab_size, r)
        out["markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, r)
        if cfg.markov_head_type == "gated":
            out["markov_head.gate_proj.weight"] = (r, d + r)
            out["markov_head.gate_proj.bias"] = (r,)
        elif cfg.markov_head_type == "rnn":
            out["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            out["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg.enable_confidence_head:
        extra = r if cfg.confidence_head_with_markov else 0
        out["confidence_head.proj.weight"] = (1, d + extra)
        out["confidence_head.proj.bias"] = (1,)
    return out


def d2t_from_t2d(t2d: torch.Tensor) -> torch.Tensor:
    """bool ``t2d`` [V_target] (True = in the draft vocabulary) -> long offsets ``d2t`` [V_draft] with
    ``target_id = draft_id + d2t[draft_id]`` (draft ids in increasing target-id order)."""
    target_ids = torch.nonzero(t2d.to(torch.bool), as_tuple=False).flatten()
    return target_ids - torch.arange(target_ids.numel(), dtype=target_ids.dtype, device=target_ids.device)

