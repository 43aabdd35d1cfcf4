"""DFlash / DSpark drafter modules: a block-diffusion draft backbone conditioned on target features by
KV injection, plus DSpark's Markov logit-bias head and confidence head.

Layout of one drafting step for a sequence whose next (not yet verified) token is the *anchor* at
absolute position ``p`` (the target's last sampled "bonus" token):

* the draft cache holds, per draft layer, the projected K/V of the context features (the outputs of
  ``cfg.target_layer_ids`` in the target, concatenated, then ``hidden_norm(fc(.))``) at every
  committed position ``< p``; each step only the newly committed tokens' features are projected
  (``DraftCache.extend``);
* the block input is ``[embed(anchor), embed(mask) x (B-1)]`` at positions ``p .. p+B-1``, with the
  TARGET's embedding (``embed_fn``; never copied into the drafter);
* every layer attends from the block to ``[context ; block]`` (context strictly before ``p``, the
  block bidirectionally: no causal mask inside the block);
* the final-normed block hidden states give the draft slots: **anchor-first** (DSpark,
  ``sample_from_anchor=True``): all B slots, slot k predicts position ``p+k+1``; **mask-only**
  (DFlash, ``sample_from_anchor=False``): slots 1..B-1, slot k predicts position ``p+k`` (the anchor
  slot gives no draft). ``DSparkConfig.num_drafts`` is B or B-1 accordingly;
* ``draft_block`` turns the draft slots into tokens left to right: base logits ``U_k`` (the target's
  lm_head, or the drafter's own pruned head when ``draft_vocab_size < vocab_size``) plus the Markov
  bias ``B_k(x_{k-1})`` (``x_0`` = the anchor), greedy or sampled; with a sampled draft the exact
  corrected distribution ``q_k`` is kept (mapped to the target vocabulary) for lossless rejection
  sampling.

Parameter names follow the DeepSpec checkpoints (``fc.weight``, ``hidden_norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``, ``markov_head.markov_w1.weight [V, r]``, ``markov_head.markov_w2.weight [V_draft, r]``,
``markov_head.gate_proj.*`` / ``markov_head.joint_proj.*``, ``confidence_head.proj.{weight,bias}``)
plus, for a pruned draft vocabulary, ``lm_head.weight [V_draft, d]`` and the ``d2t`` offsets
(``target_id = draft_id + d2t[draft_id]``). ``expected_state_shapes(cfg)`` lists them;
``specserve.spec_decode.dspark.formats`` converts DeepSpec, speculators and z-lab checkpoints to them.

Tensor parallelism: the drafter is replicated on every rank (its inputs, the target's layer outputs,
are full after the target's all-reduces). The Markov head is replicated by default (the small-heads
rule: a collective per draft position costs more than the replicated weights); ``replicate=False``
shards it (``VocabParallelEmbedding`` W1 + gathered ``ParallelLMHead`` W2) for comparison.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from specserve.layers.linear import ReplicatedLinear, ShapeMismatch, default_weight_loader
from specserve.layers.norm import RMSNorm, rms_norm_heads
from specserve.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.models.loader import CheckpointError
from specserve.sample.sampler import inverse_cdf, uniforms

__all__ = [
    "MARKOV_HEAD_TYPES",
    "DSparkConfig",
    "DraftCache",
    "DFlashDrafter",
    "MarkovHead",
    "ConfidenceHead",
    "DraftBlock",
    "DraftTree",
    "draft_block",
    "draft_blocks",
    "draft_trees",
    "calibrate_confidences",
    "expected_state_shapes",
    "d2t_from_t2d",
]

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


# ---- configuration --------------------------------------------------------------------------------


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


# ---- heads ----------------------------------------------------------------------------------------


class MarkovHead(nn.Module):
    """Low-rank transition bias over the draft vocabulary, conditioned on the previous token.

    ``markov_w1``: W1 [V_target, r], indexed by the previous token's TARGET id (the anchor may be any
    target token). ``markov_w2``: W2 [V_draft, r], applied through ``LogitsProcessor``.
    vanilla: ``B_k = W2 W1[x_{k-1}]``.
    gated: ``g = sigmoid(gate_proj([h_k; W1[x_{k-1}]]))``, ``B_k = W2 (g * W1[x_{k-1}])``.
    rnn: ``z_k = [s_{k-1}; W1[x_{k-1}]; h_k]``, ``joint_proj(z_k)`` split in (gate, candidate, output),
    ``s_k = sigmoid(gate) * s_{k-1} + (1 - sigmoid(gate)) * tanh(candidate)``, ``s_0 = 0``,
    ``B_k = W2 tanh(output)`` (position k reads s_{k-1}).

    ``replicate=True`` (default): W1 is a plain ``nn.Embedding`` and W2 a ``ParallelLMHead(...,
    disable_tp=True)``: full weights on every rank, no collective per position. ``replicate=False``:
    W1 ``VocabParallelEmbedding`` (an all-reduce per lookup) and W2 a sharded ``ParallelLMHead`` (a
    gather per position) over ``tp``.
    """

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 head_type: str = "vanilla", tp: TPGroup | None = None, replicate: bool = True, dtype=torch.float32):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov_rank must be > 0, got {rank}")
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {', '.join(MARKOV_HEAD_TYPES)}, got {head_type!r}")
        tp = tp or TPGroup()
        self.vocab_size, self.draft_vocab_size = vocab_size, draft_vocab_size
        self.rank, self.hidden_size = rank, hidden_size
        self.head_type = head_type
        self.sharded = not replicate
        if replicate:
            self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype)
            self.markov_w1.weight.weight_loader = default_weight_loader
            self.markov_w2 = ParallelLMHead(draft_vocab_size, rank, tp, disable_tp=True, dtype=dtype)
        else:
            self.markov_w1 = VocabParallelEmbedding(vocab_size, rank, tp, dtype=dtype)
            self.markov_w2 = ParallelLMHead(draft_vocab_size, rank, tp, dtype=dtype)
        self.logits_processor = LogitsProcessor(draft_vocab_size)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank, dtype=dtype)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, dtype=dtype)

    def prev_embeddings(self, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """W1[x] for target-vocab ids [...] -> [..., r]."""
        return self.markov_w1(prev_token_ids.long())

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """W2 latent: [..., r] -> [..., V_draft] (gathered only when W2 is really sharded)."""
        return self.logits_processor(self.markov_w2, latent)

    def step(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor | None = None,
             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One position of the serial loop: prev ids [N] (target vocab), hidden [N, d] (the draft
        slot's final-normed state; gated/rnn only), state [N, r] (rnn; None = s_0 = 0)
        -> (bias [N, V_draft], new state (rnn) or None, W1[x] [N, r])."""
        emb = self.prev_embeddings(prev_token_ids)
        if self.head_type == "vanilla":
            return self.project(emb), None, emb
        if hidden is None:
            raise ValueError(f"the {self.head_type} Markov head needs the draft hidden states")
        hidden = hidden.to(emb.dtype)
        if self.head_type == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1)))
            return self.project(g * emb), None, emb
        if state is None:
            state = emb.new_zeros(emb.shape)
        gate, cand, out = self.joint_proj(torch.cat([state, emb, hidden], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(gate)
        new_state = g * state + (1.0 - g) * torch.tanh(cand)
        return self.project(torch.tanh(out)), new_state, emb

    def bias(self, prev_token_ids: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced bias of a whole block: prev ids [..., K] (``[anchor, x_1 .. x_{K-1}]``, target
        vocab), hidden [..., K, d] (gated/rnn) -> [..., K, V_draft]. vanilla and gated are computed for
        all positions at once; rnn is unrolled over K from s_0 = 0."""
        if self.head_type != "rnn":
            return self.step(prev_token_ids, hidden)[0]
        if hidden is None:
            raise ValueError("the rnn Markov head needs the draft hidden states")
        state, outs = None, []
        for k in range(prev_token_ids.shape[-1]):
            b, state, _ = self.step(prev_token_ids[..., k], hidden[..., k, :], state)
            outs.append(b)
        return torch.stack(outs, dim=-2)


class ConfidenceHead(nn.Module):
    """Acceptance-probability predictor: ``c_k = sigmoid(proj([h_k; W1[x_{k-1}]]))`` (``proj`` a
    ``Linear(d + r -> 1)`` with bias), or ``sigmoid(proj(h_k))`` when ``with_markov`` is False."""

    def __init__(self, hidden_size: int, markov_rank: int = 0, with_markov: bool = False, dtype=torch.float32):
        super().__init__()
        if with_markov and markov_rank <= 0:
            raise ValueError("a confidence head with_markov needs markov_rank > 0")
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1, dtype=dtype)

    def logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., d], prev_emb [..., r] (W1[x_{k-1}], with_markov only) -> [...] logits."""
        if self.with_markov:
            if prev_emb is None:
                raise ValueError("this confidence head reads W1[x_{k-1}]: pass prev_emb")
            hidden = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logits(hidden, prev_emb))


# ---- drafting loop --------------------------------------------------------------------------------


class DraftBlock(NamedTuple):
    """One block's drafts. tokens [g] long (target ids); probs [g, V_target] float32, the exact
    distribution each token was sampled from (None: greedy, deterministic drafts); confidences [g]
    float32 (None without a confidence head)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None


@torch.no_grad()
def draft_blocks(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchors,
                 markov: MarkovHead | None = None, temperatures=None, generators=None,
                 d2t: torch.Tensor | None = None, *, confidence_head: ConfidenceHead | None = None,
                 target_vocab_size: int | None = None, num_drafts: int | None = None) -> DraftBlock:
    """Draft left to right from the draft slots' hidden states of a batch of blocks.

    base_logits_fn: hidden [..., d] -> base logits U [..., V_draft] (every slot of every row in one GEMM).
    hidden [B, g, d]: the draft slots (``DFlashDrafter.draft_hidden``). anchors [B]: each row's anchor
    target id, x_0. markov: None = pure DFlash (no bias). temperatures: None (all greedy) or one per
    row; a row with None or < 1e-5 is greedy (argmax of the corrected logits), else its x_k is sampled
    from ``softmax((U_k + B_k(x_{k-1})) / T)`` with ``generators[b]`` (same seed on every TP rank).
    d2t: draft->target offsets [V_draft] for a pruned vocabulary (then ``target_vocab_size`` is needed
    for q), or the bool ``t2d`` mask [V_target] itself: x_k is mapped to its target id before the next
    Markov lookup and in the output, and q_k is scattered into the target vocabulary.
    num_drafts: stop after that many positions.

    Returns tokens [B, g] (target ids), probs [B, g, V_target] (the exact q of sampled rows, zeros for
    greedy rows; None when every row is greedy), confidences [B, g] (None without a confidence head).
    """
    B = hidden.shape[0]
    g = hidden.shape[1] if num_drafts is None else max(0, min(int(num_drafts), hidden.shape[1]))
    hidden = hidden[:, :g]
    device = hidden.device
    temps = [None] * B if temperatures is None else list(temperatures)
    gens = [None] * B if generators is None else list(generators)
    sampled = [b for b in range(B) if temps[b] is not None and temps[b] >= 1e-5]
    if confidence_head is not None and confidence_head.with_markov and markov is None:
        raise ValueError("the confidence head reads W1[x_{k-1}] but there is no Markov head")
    if d2t is not None and d2t.dtype == torch.bool:  # a t2d mask
        target_vocab_size = target_vocab_size or d2t.numel()
    to_target = draft_target_ids(d2t, device)
    if to_target is not None and sampled and target_vocab_size is None:
        raise ValueError("a pruned draft vocabulary needs target_vocab_size to map q to the target vocabulary")
    prev = torch.as_tensor(anchors, device=device, dtype=torch.long).reshape(B)
    if g == 0:
        return DraftBlock(torch.zeros(B, 0, dtype=torch.long, device=device),
                          torch.zeros(B, 0, target_vocab_size or 0, device=device) if sampled else None,
                          None if confidence_head is None else torch.zeros(B, 0, device=device))
    base = base_logits_fn(hidden).float()  # [B, g, V_draft]
    tokens, probs, embs = [], [], []
    state, drafted = None, None
    if markov is None and not sampled:  # pure DFlash, greedy: no position depends on another's draft
        drafted = base.argmax(dim=-1)
        drafted = drafted if to_target is None else to_target[drafted]
    for k in range(0 if drafted is not None else g):
        logits = base[:, k]
        if markov is not None:
            bias, state, emb = markov.step(prev, hidden[:, k], state)
            logits = torch.add(logits, bias)  # float32 (bias promoted exactly)
            embs.append(emb)
        x = logits.argmax(dim=-1)
        if sampled:
            q = torch.zeros_like(logits)
            for b in sampled:
                q[b] = torch.softmax(logits[b] / temps[b], dim=-1)
                x[b] = inverse_cdf(q[b], uniforms(1, gens[b], q.device)[0])
            probs.append(q)
        if to_target is not None:
            x = to_target[x]
        tokens.append(x)
        prev = x
    confs = None
    if confidence_head is not None:  # c_k reads [h_k; W1[x_{k-1}]]: every position in one call
        confs = confidence_head(hidden, torch.stack(embs, dim=1) if embs else None).float()
    out_probs = None
    if sampled:
        q = torch.stack(probs, dim=1)  # [B, g, V_draft]
        if to_target is not None:
            full = q.new_zeros(B, g, target_vocab_size)
            full[..., to_target] = q
            q = full
        out_probs = q
    return DraftBlock(torch.stack(tokens, dim=1) if drafted is None else drafted, out_probs, confs)


def draft_target_ids(d2t: torch.Tensor | None, device=None) -> torch.Tensor | None:
    """The target id of every draft id [V_draft] from ``d2t`` offsets or a bool ``t2d`` mask (None: the
    draft vocabulary is the target's)."""
    if d2t is None:
        return None
    if d2t.dtype == torch.bool:
        d2t = d2t_from_t2d(d2t)
    return torch.arange(d2t.numel(), device=device, dtype=torch.long) + d2t.to(device=device, dtype=torch.long)


def confidence_temperature_list(temperatures, g: int) -> list[float]:
    """The sequential-temperature-scaling divisor of each of ``g`` slots: ``temperatures[k]``, or 1 past
    the end of the list (or None) or for a non-positive entry."""
    return [float(x) if float(x) > 0 else 1.0 for x in (list(temperatures or []) + [1.0] * g)[:g]]


def calibrate_confidences(c: torch.Tensor, temperatures) -> torch.Tensor:
    """Confidences [..., g] after sequential temperature scaling: slot k's logit divided by
    ``temperatures[k]`` (``confidence_temperature_list``); float32."""
    c = c.float()
    if not temperatures:
        return c
    t = confidence_temperature_list(temperatures, c.shape[-1])
    return torch.sigmoid(torch.logit(c.clamp(1e-6, 1 - 1e-6)) / torch.tensor(t, device=c.device))


class DraftTree(NamedTuple):
    """Candidate nodes of a batch of draft trees (``draft_trees``); each row's root, its anchor, is not
    a candidate. tokens [B, C] target ids; parents [B, C] long: -1 for a child of the root, else the
    parent's candidate index, always smaller than the node's own (candidates come depth by depth);
    depth [C] long (1 = a child of the root; the same layout for every row); scores [B, C] float32:
    the estimated probability that the whole path root -> node is accepted (never above the
    parent's)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor


@torch.no_grad()
def draft_trees(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchors,
                markov: MarkovHead | None = None, *, topk: int = 4, beam: int = 4, temperatures=None,
                confidence_head: ConfidenceHead | None = None, confidence_temperatures=None,
                d2t: torch.Tensor | None = None, num_drafts: int | None = None) -> DraftTree:
    """Candidate draft trees from the draft slots of a batch of blocks, expanded best first.

    The block forward gives every depth k its base logits ``U_k`` once; a node's children come from
    ``U_k + B_k(x)``, the Markov bias of the node's OWN token x (and, for the rnn head, the state
    along its own path), so every branch is drafted as if it were the chain. Depth 1 holds the
    ``topk`` children of the root; each further depth holds the ``topk`` children of each of the
    ``beam`` best-scoring nodes of the depth before.

    A node's score is the product along its path of the probability that each step is accepted given
    its parent was: for a greedy row (temperature None or < 1e-5) with a confidence head, the
    (calibrated, ``confidence_temperatures`` one per depth) confidence ``c`` for the rank-0 child and
    ``(1 - c) * q_r / (1 - q_0)`` for rank r > 0 (the rest of the mass, shared as the draft
    distribution shares it); otherwise the draft probability ``q`` at the row's temperature (1 for
    greedy rows), the chance that the target's own draw is that token. The scores only choose which
    candidates are verified; verification is exact.
    """
    B = hidden.shape[0]
    g = hidden.shape[1] if num_drafts is None else max(0, min(int(num_drafts), hidden.shape[1]))
    hidden = hidden[:, :g]
    device = hidden.device
    if confidence_head is not None and confidence_head.with_markov and markov is None:
        raise ValueError("the confidence head reads W1[x_{k-1}] but there is no Markov head")
    if topk < 1 or beam < 1:
        raise ValueError(f"topk and beam must be >= 1, got {topk} and {beam}")
    temps = [None] * B if temperatures is None else list(temperatures)
    is_greedy = [t is None or t < 1e-5 for t in temps]
    scale = greedy = None  # all rows greedy: no temperature division, no per-row choice of the factor
    if not all(is_greedy):
        scale = torch.tensor([1.0 if gr else float(t) for gr, t in zip(is_greedy, temps)], device=device).view(B, 1, 1)
        greedy = torch.tensor(is_greedy, device=device).view(B, 1, 1)
    ctemps = confidence_temperature_list(confidence_temperatures, g)
    to_target = draft_target_ids(d2t, device)
    prev = torch.as_tensor(anchors, device=device, dtype=torch.long).reshape(B, 1)
    fscore = torch.ones(B, 1, device=device)
    fidx = torch.full((B, 1), -1, dtype=torch.long, device=device)
    base = base_logits_fn(hidden).float() if g else None  # [B, g, V_draft]
    state, toks, pars, scores, depth, offset = None, [], [], [], [], 0
    for k in range(g):
        W, V = prev.shape[1], base.shape[-1]
        kk = min(topk, V)
        h = hidden[:, k : k + 1].expand(B, W, hidden.shape[-1]).reshape(B * W, -1)
        logits = base[:, k : k + 1].expand(B, W, V)
        emb = None
        if markov is not None:
            bias, state, emb = markov.step(prev.reshape(-1), h, state)
            logits = torch.add(logits, bias.view(B, W, V))  # float32 (bias promoted exactly)
        top_q, top_i = torch.softmax(logits if scale is None else logits / scale, dim=-1).topk(kk, dim=-1)
        factor = top_q  # [B, W, kk]
        if confidence_head is not None and any(is_greedy):
            # the calibrated confidence: sigmoid(logit / T_k) (sequential temperature scaling)
            c = torch.sigmoid(confidence_head.logits(h, emb).float().view(B, W, 1) / ctemps[k])
            rest = (1.0 - c) * top_q[..., 1:] / (1.0 - top_q[..., :1]).clamp_min(1e-6)
            factor = torch.cat([c, rest.clamp(max=1.0)], dim=-1)
            factor = factor if scale is None else torch.where(greedy, factor, top_q)
        child = (fscore.unsqueeze(-1) * factor).reshape(B, W * kk)
        tok = top_i.reshape(B, W * kk)
        tok = to_target[tok] if to_target is not None else tok
        toks.append(tok)
        pars.append(fidx.unsqueeze(-1).expand(B, W, kk).reshape(B, W * kk))
        scores.append(child)
        depth += [k + 1] * (W * kk)
        if k + 1 < g:  # the next depth expands this depth's best nodes
            fscore, j = child.topk(min(beam, W * kk), dim=-1)
            prev, fidx = tok.gather(1, j), offset + j
            if state is not None:  # rnn: a child continues its parent's state
                state = state.view(B, W, -1).gather(1, (j // kk).unsqueeze(-1).expand(-1, -1, state.shape[-1]))
                state = state.reshape(B * j.shape[1], -1)
        offset += W * kk
    if not toks:
        empty = torch.zeros(B, 0, dtype=torch.long, device=device)
        return DraftTree(empty, empty, torch.zeros(0, dtype=torch.long, device=device),
                         torch.zeros(B, 0, device=device))
    return DraftTree(torch.cat(toks, 1), torch.cat(pars, 1), torch.tensor(depth, dtype=torch.long, device=device),
                     torch.cat(scores, 1))


def draft_block(base_logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, anchor,
                markov: MarkovHead | None = None, temperature: float | None = 0.0,
                generator: torch.Generator | None = None, d2t: torch.Tensor | None = None, *,
                confidence_head: ConfidenceHead | None = None, target_vocab_size: int | None = None,
                num_drafts: int | None = None) -> DraftBlock:
    """``draft_blocks`` for one block: hidden [g, d], anchor an int (or 0-d tensor), one temperature
    and generator -> tokens [g], probs [g, V_target] (None when greedy), confidences [g] or None."""
    anchor = torch.as_tensor(anchor, dtype=torch.long).reshape(1)
    out = draft_blocks(base_logits_fn, hidden.unsqueeze(0), anchor, markov, [temperature], [generator], d2t,
                       confidence_head=confidence_head, target_vocab_size=target_vocab_size, num_drafts=num_drafts)
    return DraftBlock(out.tokens[0], None if out.probs is None else out.probs[0],
                      None if out.confidences is None else out.confidences[0])


# ---- backbone -------------------------------------------------------------------------------------


class DFlashAttention(nn.Module):
    """Non-causal attention of the block over ``[context ; block]``. K/V of the context are computed
    once by ``project_kv`` (cached); the block's own K/V in every forward."""

    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        d, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q_proj = ReplicatedLinear(d, H * D, cfg.attention_bias, dtype=dtype)
        self.k_proj = ReplicatedLinear(d, Hkv * D, cfg.attention_bias, dtype=dtype)
        self.v_proj = ReplicatedLinear(d, Hkv * D, cfg.attention_bias, dtype=dtype)
        self.o_proj = ReplicatedLinear(H * D, d, False, dtype=dtype)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.scale = D**-0.5
        self.qkv_proj = None  # set by ``fuse``
        self.qk_norm_weight = None

    def fuse(self) -> None:
        """For inference: q, k and v in one GEMM (one weight read, one call), and q_norm, k_norm and the
        rotation over all heads of q and k at once. Same math as the separate layers (each output is the
        same dot product; the norms are per head); the separate q/k/v weights are dropped, so a fused
        layer no longer trains or saves."""
        self.qkv_proj = ReplicatedLinear.stacked([self.q_proj, self.k_proj, self.v_proj])
        self.qk_norm_weight = torch.cat([self.q_norm.weight.data.expand(self.H, self.D),
                                         self.k_norm.weight.data.expand(self.Hkv, self.D)])
        self.q_proj = self.k_proj = self.v_proj = None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., n, d] -> k, v [..., Hkv, n, D] (k normed per head and rotated at its positions)."""
        shape = (*x.shape[:-1], self.Hkv, self.D)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        v = self.v_proj(x).view(shape)
        return k.transpose(-3, -2), v.transpose(-3, -2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        """A batch of S rows of Q block tokens each: x [S, Q, d] (after input_layernorm), cos/sin
        [S, Q, 1, D], ctx_k/v [S, Hkv, n, D] (the context, already projected), mask None or bool
        [S, 1, Q, n + Q] -> [S, Q, d]. Differentiable (the trainer runs it too)."""
        S, Q, _ = x.shape
        if self.qkv_proj is not None:  # fused for inference (``fuse``)
            H, Hkv = self.H, self.Hkv
            qkv = self.qkv_proj(x).view(S, Q, H + 2 * Hkv, self.D)
            qk = apply_rotary(rms_norm_heads(qkv[:, :, : H + Hkv], self.qk_norm_weight, self.q_norm.eps), cos, sin)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            v = qkv[:, :, H + Hkv :].transpose(1, 2)
        else:
            q = apply_rotary(self.q_norm(self.q_proj(x).view(S, Q, self.H, self.D)), cos, sin).transpose(1, 2)
            k = apply_rotary(self.k_norm(self.k_proj(x).view(S, Q, self.Hkv, self.D)), cos, sin).transpose(1, 2)
            v = self.v_proj(x).view(S, Q, self.Hkv, self.D).transpose(1, 2)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.H != self.Hkv)  # no repeated copies of k/v
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, self.H * self.D))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        self.gate_proj = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, False, dtype=dtype)
        self.up_proj = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, False, dtype=dtype)
        self.down_proj = ReplicatedLinear(cfg.intermediate_size, cfg.hidden_size, False, dtype=dtype)
        self.gate_up_proj = None  # set by ``fuse``

    def fuse(self) -> None:
        """For inference: gate and up projections in one GEMM (the separate weights are dropped)."""
        self.gate_up_proj = ReplicatedLinear.stacked([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DFlashAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = DFlashMLP(cfg, dtype)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftCache:
    """The drafter's KV cache of ONE sequence: per draft layer, the projected K/V of the context
    features at their absolute positions. ``extend`` projects only the new rows; ``crop(n)`` keeps the
    first n entries (rollback). The block's own K/V are never stored (each step recomputes them), so
    nothing needs cropping after a block forward."""

    def __init__(self, drafter: "DFlashDrafter", capacity: int = 64):
        cfg = drafter.cfg
        self.drafter = drafter
        self.length = 0
        p = next(drafter.parameters())
        self._shape = (cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim)
        self._dtype, self._device = p.dtype, p.device
        self._alloc(max(1, capacity))

    def _alloc(self, cap: int) -> None:
        L, Hkv, D = self._shape
        k = torch.zeros(L, Hkv, cap, D, dtype=self._dtype, device=self._device)
        v = torch.zeros_like(k)
        pos = torch.zeros(cap, dtype=torch.long, device=self._device)
        if getattr(self, "k", None) is not None and self.length:
            n = self.length
            k[:, :, :n], v[:, :, :n], pos[:n] = self.k[:, :, :n], self.v[:, :, :n], self._pos[:n]
        self.k, self.v, self._pos = k, v, pos

    @property
    def capacity(self) -> int:
        return self._pos.shape[0]

    def __len__(self) -> int:
        return self.length

    @property
    def positions(self) -> torch.Tensor:
        return self._pos[: self.length]

    @torch.no_grad()
    def extend(self, features: torch.Tensor, positions) -> None:
        """Append the context rows ``features`` [n, m*d] (target layer outputs, concatenated in
        ``target_layer_ids`` order) at absolute ``positions`` [n]."""
        n = features.shape[0]
        if n == 0:
            return
        positions = torch.as_tensor(positions, dtype=torch.long, device=self._device).reshape(-1)
        if positions.numel() != n:
            raise ValueError(f"{n} feature rows but {positions.numel()} positions")
        k, v = self.drafter.project_context(features, positions)
        if self.length + n > self.capacity:
            self._alloc(max(self.length + n, 2 * self.capacity))
        a, b = self.length, self.length + n
        self.k[:, :, a:b] = k
        self.v[:, :, a:b] = v
        self._pos[a:b] = positions
        self.length = b

    def crop(self, n: int) -> None:
        """Keep the first ``n`` entries."""
        if not (0 <= n <= self.length):
            raise ValueError(f"cannot crop a draft cache of {self.length} entries to {n}")
        self.length = n

    def reset(self) -> None:
        self.length = 0

    def layer_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i, :, : self.length], self.v[i, :, : self.length]


class DFlashDrafter(nn.Module):
    """The DFlash backbone (``fc``, ``hidden_norm``, ``layers``, ``norm``) with DSpark's optional
    ``markov_head`` / ``confidence_head`` and, for a pruned vocabulary, its own ``lm_head`` + ``d2t``.
    Embedding and (full-vocabulary) lm_head are the target's, passed at call time.

    ``forward_blocks`` runs one block per sequence for a batch of sequences (each with its own
    ``DraftCache``, the contexts padded and masked) in one forward; ``forward_block`` is one of them;
    ``forward_anchored_blocks`` is the trainer's shape (many blocks per sequence over its whole context)."""

    def __init__(self, cfg: DSparkConfig, tp: TPGroup | None = None, dtype=torch.float32,
                 markov_replicate: bool = True):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = ReplicatedLinear(cfg.num_aux_layers * d, d, False, dtype=dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, 4096, cfg.rope_scaling)
        self.lm_head = None
        d2t = None
        if cfg.pruned_vocab:  # the drafter's own head over the draft vocabulary, replicated
            self.lm_head = ParallelLMHead(cfg.draft_vocab_size, d, tp, disable_tp=True, dtype=dtype)
            d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        self.register_buffer("d2t", d2t)  # draft id -> target id offsets (None: same vocabulary)
        self.logits_processor = LogitsProcessor(cfg.draft_vocab_size)
        self.markov_head = None
        if cfg.has_markov:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.draft_vocab_size, cfg.markov_rank, d,
                                          cfg.markov_head_type, tp, markov_replicate, dtype)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(d, cfg.markov_rank, cfg.confidence_head_with_markov, dtype)
        self.ctx_kv_proj = None  # ``fuse_projections``
        self.ctx_k_norm_weight = None

    # -- context ------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 64) -> DraftCache:
        return DraftCache(self, capacity)

    def context_features(self, features: torch.Tensor) -> torch.Tensor:
        """H_ctx = hidden_norm(fc(features)): [n, m*d] -> [n, d]."""
        w = self.hidden_norm.weight
        return self.hidden_norm(self.fc(features.to(device=w.device, dtype=w.dtype)))

    def project_context(self, features: torch.Tensor, positions: torch.Tensor):
        """Context rows [n, m*d] at positions [n] -> k, v [num_layers, Hkv, n, D] (every layer's)."""
        h = self.context_features(features)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if self.ctx_kv_proj is None:
            kv = [layer.self_attn.project_kv(h, cos, sin) for layer in self.layers]
            return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])
        n, L, Hkv, D = h.shape[0], len(self.layers), self.cfg.num_key_value_heads, self.cfg.head_dim
        kv = self.ctx_kv_proj(h).view(n, 2, L * Hkv, D)
        k = apply_rotary(rms_norm_heads(kv[:, 0], self.ctx_k_norm_weight, self.cfg.rms_norm_eps), cos, sin)
        return k.view(n, L, Hkv, D).permute(1, 2, 0, 3), kv[:, 1].view(n, L, Hkv, D).permute(1, 2, 0, 3)

    def fuse_projections(self) -> None:
        """For inference (the drafting worker): fewer, larger GEMMs and fewer small ops per drafting step,
        the same math. Each layer's q/k/v and gate/up projections become one GEMM each
        (``DFlashAttention.fuse``, ``DFlashMLP.fuse``), and the context K/V of all layers one GEMM with
        their k_norms in one call (``project_context``). Call after the weights are loaded and before
        ``pack_linears``; a fused drafter no longer trains or saves."""
        if self.ctx_kv_proj is not None:
            return
        attn = [layer.self_attn for layer in self.layers]
        self.ctx_kv_proj = ReplicatedLinear.stacked([a.k_proj for a in attn] + [a.v_proj for a in attn])
        self.ctx_k_norm_weight = torch.cat([a.k_norm.weight.data.expand(a.Hkv, a.D) for a in attn])
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    # -- block --------------------------------------------------------------------------------------
    def block_input_ids(self, anchor) -> torch.Tensor:
        """[anchor, mask x (block_size - 1)] (target ids) -> [block_size] long."""
        ids = torch.full((self.cfg.block_size,), int(self.cfg.mask_token_id), dtype=torch.long,
                         device=self.norm.weight.device)
        ids[0] = torch.as_tensor(anchor).reshape(())
        return ids

    @torch.no_grad()
    def forward_block(self, anchor, start_pos: int, cache: DraftCache,
                      embed_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block ``[anchor, mask x (B-1)]`` at positions ``start_pos ..`` over the cached context
        -> final-normed hidden [B, d] of every slot (``draft_hidden`` selects the draft slots).
        ``embed_fn``: the target's embedding, ids [n] -> [n, d]."""
        x = embed_fn(self.block_input_ids(anchor))
        return self.forward_block_embeds(x, start_pos, cache)

    @torch.no_grad()
    def forward_block_embeds(self, x: torch.Tensor, start_pos: int, cache: DraftCache) -> torch.Tensor:
        """Block input embeddings [B, d] at positions ``start_pos .. start_pos+B-1`` -> [B, d]. The block
        sees every cached context entry at a position < ``start_pos`` and itself, bidirectionally."""
        return self.forward_blocks(x.unsqueeze(0), [start_pos], [cache])[0]

    @torch.no_grad()
    def forward_blocks(self, x: torch.Tensor, start_pos, caches: list) -> torch.Tensor:
        """A batch of blocks, one per sequence: input embeddings x [S, B, d], row s at positions
        ``start_pos[s] ..`` over ``caches[s]`` -> final-normed hidden [S, B, d]. Each row sees the
        entries of its own cache at positions < its start and its own block, bidirectionally."""
        S, B = x.shape[:2]
        x = x.to(device=self.norm.weight.device, dtype=self.norm.weight.dtype)
        dev = x.device
        starts = torch.as_tensor(list(start_pos), dtype=torch.long, device=dev).reshape(S)
        pos = starts.unsqueeze(1) + torch.arange(B, device=dev)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        n = max(len(c) for c in caches)
        if S == 1:  # views of the one cache, no copy
            visible = caches[0].positions.unsqueeze(0) < starts.unsqueeze(1)
            kv = [tuple(t.unsqueeze(0) for t in caches[0].layer_kv(i)) for i in range(len(self.layers))]
        else:  # the contexts right-padded to the longest
            Hkv, D = self.cfg.num_key_value_heads, self.cfg.head_dim
            visible = torch.zeros(S, n, dtype=torch.bool, device=dev)
            kv = []
            for i in range(len(self.layers)):
                k = x.new_zeros(S, Hkv, n, D)
                v = x.new_zeros(S, Hkv, n, D)
                for r, c in enumerate(caches):
                    ck, cv = c.layer_kv(i)
                    k[r, :, : len(c)], v[r, :, : len(c)] = ck, cv
                kv.append((k, v))
            for r, c in enumerate(caches):
                visible[r, : len(c)] = c.positions < starts[r]
        mask = None
        if n and not bool(visible.all()):
            mask = torch.cat([visible.unsqueeze(1).expand(S, B, n),
                              visible.new_ones(S, B, B)], dim=-1).unsqueeze(1)  # [S, 1, B, n + B]
        return self._decode(x, cos, sin, kv, mask)

    def forward_anchored_blocks(self, x: torch.Tensor, anchors: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The training shape: N blocks of each of S sequences over its whole context, in one differentiable
        forward. x [S, N, B, d]: block input embeddings; anchors [S, N]: the position of each block's first
        slot; features [S, T, m*d]: each sequence's context features at positions 0 .. T-1 (zero past its
        end) -> final-normed hidden [S, N, B, d]. Block (s, n) sees row s's context at positions
        < anchors[s, n] and itself, bidirectionally, not the other blocks: what ``forward_blocks`` gives it
        over a ``DraftCache`` holding that context."""
        S, N, B = x.shape[:3]
        T, dtype, dev = features.shape[1], self.norm.weight.dtype, features.device
        x = x.reshape(S, N * B, -1).to(dtype)
        pos = (anchors.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(S, N * B)
        ctx = self.context_features(features)  # [S, T, d]
        cpos = torch.arange(T, device=dev).unsqueeze(0).expand(S, T)
        cos, sin = self.rotary.cos_sin(pos, dtype)
        cos_c, sin_c = self.rotary.cos_sin(cpos, dtype)
        vis_ctx = cpos.unsqueeze(1) < anchors.repeat_interleave(B, dim=1).unsqueeze(2)  # [S, N*B, T]
        blk = torch.arange(N, device=dev).repeat_interleave(B)
        vis_blk = (blk.unsqueeze(1) == blk.unsqueeze(0)).unsqueeze(0).expand(S, N * B, N * B)
        mask = torch.cat([vis_ctx, vis_blk], dim=-1).unsqueeze(1)
        kv = [layer.self_attn.project_kv(ctx, cos_c, sin_c) for layer in self.layers]
        return self._decode(x, cos, sin, kv, mask).view(S, N, B, -1)

    def _decode(self, h, cos, sin, kv, mask) -> torch.Tensor:
        """The decoder layers over the projected context ``kv`` (one (k, v) per layer), then the final norm."""
        for layer, (ck, cv) in zip(self.layers, kv):
            h = layer(h, cos, sin, ck, cv, mask)
        return self.norm(h)

    def draft_hidden(self, block_hidden: torch.Tensor) -> torch.Tensor:
        """[..., B, d] -> the draft slots [..., num_drafts, d] (all slots anchor-first; slots 1.. mask-only)."""
        return block_hidden[..., self.cfg.first_draft_slot :, :]

    # -- logits and drafting ------------------------------------------------------------------------
    def base_logits(self, hidden: torch.Tensor,
                    target_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """U = lm_head(h) over the draft vocabulary, float32: the drafter's own head for a pruned
        vocabulary (never the target's), else ``target_logits_fn`` (the target's ``compute_logits``)."""
        if self.lm_head is not None:
            return self.logits_processor(self.lm_head, hidden).float()
        if target_logits_fn is None:
            raise ValueError("this drafter uses the target's lm_head: pass target_logits_fn")
        return target_logits_fn(hidden).float()

    @torch.no_grad()
    def propose(self, anchor, start_pos: int, cache: DraftCache, embed_fn, target_logits_fn=None,
                temperature: float | None = 0.0, generator: torch.Generator | None = None,
                num_drafts: int | None = None) -> DraftBlock:
        """One drafting step of one sequence: block forward + ``draft_block``."""
        hidden = self.draft_hidden(self.forward_block(anchor, start_pos, cache, embed_fn))
        return draft_block(lambda h: self.base_logits(h, target_logits_fn), hidden, anchor, self.markov_head,
                           temperature, generator, self.d2t, confidence_head=self.confidence_head,
                           target_vocab_size=self.cfg.vocab_size, num_drafts=num_drafts)

    @torch.no_grad()
    def propose_batch(self, anchors: list[int], start_pos: list[int], caches: list, embed_fn, target_logits_fn=None,
                      temperatures=None, generators=None, num_drafts: int | None = None) -> DraftBlock:
        """One drafting step of a batch of sequences (one block forward, one base-logits GEMM, the
        Markov loop batched): ``draft_blocks`` outputs with a leading batch dimension."""
        ids, hidden = self._draft_slots(anchors, start_pos, caches, embed_fn)
        return draft_blocks(lambda h: self.base_logits(h, target_logits_fn), hidden, ids[:, 0], self.markov_head,
                            temperatures, generators, self.d2t, confidence_head=self.confidence_head,
                            target_vocab_size=self.cfg.vocab_size, num_drafts=num_drafts)

    @torch.no_grad()
    def propose_tree_batch(self, anchors: list[int], start_pos: list[int], caches: list, embed_fn,
                           target_logits_fn=None, temperatures=None, num_drafts: int | None = None, topk: int = 4,
                           beam: int = 4, confidence_temperatures=None) -> DraftTree:
        """Candidate draft trees of a batch of sequences (``draft_trees``) from one block forward."""
        ids, hidden = self._draft_slots(anchors, start_pos, caches, embed_fn)
        return draft_trees(lambda h: self.base_logits(h, target_logits_fn), hidden, ids[:, 0], self.markov_head,
                           topk=topk, beam=beam, temperatures=temperatures, confidence_head=self.confidence_head,
                           confidence_temperatures=confidence_temperatures, d2t=self.d2t, num_drafts=num_drafts)

    def _draft_slots(self, anchors, start_pos, caches, embed_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """Block input ids [S, B] and the draft slots' hidden states [S, g, d] of one block forward."""
        ids = torch.stack([self.block_input_ids(a) for a in anchors])  # [S, B]
        x = embed_fn(ids.reshape(-1)).view(ids.shape[0], ids.shape[1], -1)
        return ids, self.draft_hidden(self.forward_blocks(x, start_pos, caches))

    # -- weights ------------------------------------------------------------------------------------
    def _tensors(self) -> dict[str, torch.Tensor]:
        if self.ctx_kv_proj is not None:
            raise RuntimeError("a drafter fused for inference (fuse_projections) has no checkpoint tensors")
        out = dict(self.named_parameters())
        if self.d2t is not None:
            out["d2t"] = self.d2t
        return out

    def state_for_save(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._tensors().items()}

    def load_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Load our names (``expected_state_shapes``); every tensor must be present with its exact
        shape. Errors name the tensor."""
        want = self._tensors()
        missing = sorted(set(want) - set(sd))
        if missing:
            raise CheckpointError(f"drafter checkpoint is missing {', '.join(missing[:6])}"
                                  + (" ..." if len(missing) > 6 else ""))
        unexpected = sorted(set(sd) - set(want))
        if unexpected:
            raise CheckpointError(f"drafter checkpoint has unexpected tensors {', '.join(unexpected[:6])}")
        with torch.no_grad():
            for name, p in want.items():
                t = sd[name]
                try:
                    if name == "d2t":
                        if tuple(t.shape) != tuple(p.shape):
                            raise ShapeMismatch(tuple(p.shape), tuple(t.shape))
                        p.copy_(t.to(torch.long))
                        continue
                    getattr(p, "weight_loader", default_weight_loader)(p, t.to(p.dtype))
                except ShapeMismatch as e:
                    raise CheckpointError(f"drafter tensor {name!r}: checkpoint shape {e.got}, "
                                          f"expected {e.expected}") from None
